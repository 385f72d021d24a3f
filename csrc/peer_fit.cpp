// llama.cpp's own fit (common_fit_params) of llama-server arguments, on devices that
// have exactly the room given: what llama-server, which runs it on every load, would
// make of the same arguments under the same budget.  The peer the router's fit is
// measured against (bench/fit_bench.py, tests/admission/test_context.py): it parses the
// arguments as the engine does, then calls llama.cpp's fit with margins that leave
// each device's room (llama.cpp compares with what a device has free, and with the
// host's total memory where there is no device).
#include "params.h"

#include <chrono>
#include <cstdint>

#include "common.h"
#include "fit.h"
#include "ggml-backend.h"
#include "llama.h"
#include "probe.h"

namespace pyllmrouter {

PeerFit llama_fit(const std::vector<std::string> & args, const std::vector<std::pair<std::string, std::uint64_t>> & rooms) {
    common_params params = parse_server_args(args, nullptr, /*resolve_ctx =*/false);
    // the devices given, in order (as -dev would name them); none: the host alone
    std::uint64_t host_room = 0;
    bool host_given = false;
    params.devices.clear();
    for (const auto & [name, room] : rooms) {
        if (name == "CPU") {
            host_room = room;
            host_given = true;
        } else {
            params.devices.push_back(static_cast<ggml_backend_dev_t>(device_handle(name)));
        }
    }
    const bool devices_given = !params.devices.empty();
    params.devices.push_back(nullptr);
    llama_model_params mparams = common_model_params_to_llama(params);
    llama_context_params cparams = common_context_params_to_llama(params);

    std::vector<size_t> margins(llama_max_devices(), 0);
    size_t i = 0;
    for (const auto & [name, room] : rooms) {
        if (name == "CPU") continue;
        size_t free = 0, total = 0;
        ggml_backend_dev_memory(static_cast<ggml_backend_dev_t>(device_handle(name)), &free, &total);
        margins[i++] = free > room ? free - room : 0;
    }
    if (!devices_given && host_given) {  // the host alone: llama.cpp compares with its total memory
        ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
        size_t free = 0, total = 0;
        ggml_backend_dev_memory(cpu, &free, &total);
        margins[0] = total > host_room ? total - host_room : 0;
    }
    PeerFit out;
    const auto t0 = std::chrono::steady_clock::now();
    out.log = capture_log([&] {
        out.status = static_cast<int>(common_fit_params(params.model.path.c_str(), &mparams, &cparams,
                                                        params.tensor_split, params.tensor_buft_overrides.data(),
                                                        margins.data(), params.fit_params_min_ctx, nullptr,
                                                        GGML_LOG_LEVEL_ERROR));
    });
    out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    out.n_ctx = static_cast<std::int32_t>(cparams.n_ctx);
    out.n_gpu_layers = mparams.n_gpu_layers;
    for (size_t d = 0; d < (devices_given ? i : 0); ++d) out.tensor_split.push_back(params.tensor_split[d]);
    for (const auto & o : params.tensor_buft_overrides) {
        if (o.pattern == nullptr) break;
        out.overrides.emplace_back(o.pattern, o.buft ? ggml_backend_buft_name(o.buft) : "");
    }
    return out;
}

}  // namespace pyllmrouter
