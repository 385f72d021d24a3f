// The bytes of a LoRA adapter, per buffer type, as llama_adapter_lora_init would
// allocate them for a given model (src/llama-adapter.cpp): each lora_a/lora_b pair
// goes to the buffer type of the model tensor it adapts (the CPU's for an extra,
// repacking, buffer type), and each buffer type's tensors are sized as ggml
// allocates them.  Nothing is allocated and no tensor data is read.
//
// This is the one translation unit that sees llama.cpp's internal headers (for
// llama_model::get_tensor, which libllama exports): see CMakeLists.txt.
#include "probe.h"

#include <map>
#include <memory>
#include <string>

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "gguf.h"
#include "llama-model.h"

namespace pyllmrouter {
namespace {

std::string kv_str(const gguf_context * g, const char * key) {
    const int64_t id = gguf_find_key(g, key);
    return id >= 0 && gguf_get_kv_type(g, id) == GGUF_TYPE_STRING ? gguf_get_val_str(g, id) : "";
}

bool ends_with(const std::string & s, const std::string & suffix) {
    return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

std::vector<BufferRow> lora_rows(const llama_model * model, const std::string & path) {
    ggml_context * meta = nullptr;
    gguf_init_params ip = {/*no_alloc =*/true, /*ctx =*/&meta};
    std::unique_ptr<gguf_context, decltype(&gguf_free)> g(gguf_init_from_file(path.c_str(), ip), &gguf_free);
    std::unique_ptr<ggml_context, decltype(&ggml_free)> tensors(meta, &ggml_free);
    if (!g || !meta) {
        throw probe_error(path + ": lora: not a readable GGUF file");
    }
    if (kv_str(g.get(), "general.type") != "adapter" || kv_str(g.get(), "adapter.type") != "lora") {
        throw probe_error(path + ": lora: not a LoRA adapter (general.type, adapter.type)");
    }
    char arch[128] = {0};
    llama_model_meta_val_str(model, "general.architecture", arch, sizeof(arch));
    if (kv_str(g.get(), "general.architecture") != arch) {
        throw probe_error(path + ": lora: made for " + kv_str(g.get(), "general.architecture") +
                          ", the model is " + arch);
    }
    std::map<std::string, std::pair<ggml_tensor *, ggml_tensor *>> pairs;
    for (ggml_tensor * t = ggml_get_first_tensor(meta); t != nullptr; t = ggml_get_next_tensor(meta, t)) {
        const std::string name = t->name;
        if (ends_with(name, ".lora_a")) {
            pairs[name.substr(0, name.size() - 7)].first = t;
        } else if (ends_with(name, ".lora_b")) {
            pairs[name.substr(0, name.size() - 7)].second = t;
        } else if (!ends_with(name, "_norm.weight")) {
            throw probe_error(path + ": lora: tensor '" + name + "' has an unexpected suffix");
        }
    }
    // the CPU's extra buffer types (repacking): adapters fall back to the CPU's own
    std::vector<ggml_backend_buffer_type_t> extra;
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (cpu != nullptr) {
        auto fn = (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(
            ggml_backend_dev_backend_reg(cpu), "ggml_backend_dev_get_extra_bufts");
        for (auto * b = fn ? fn(cpu) : nullptr; b && *b; ++b) extra.push_back(*b);
    }
    const int64_t n = gguf_get_n_tensors(g.get());
    std::map<ggml_backend_buffer_type_t, std::unique_ptr<ggml_context, decltype(&ggml_free)>> by_buft;
    for (const auto & [name, ab] : pairs) {
        if (ab.first == nullptr || ab.second == nullptr) {
            throw probe_error(path + ": lora: the pair for '" + name + "' is missing one tensor");
        }
        const ggml_tensor * base = model->get_tensor(name.c_str());
        if (base == nullptr || base->buffer == nullptr) {
            throw probe_error(path + ": lora: '" + name + "' is not a tensor of the model");
        }
        ggml_backend_buffer_type_t buft = ggml_backend_buffer_get_type(base->buffer);
        for (auto * e : extra) {
            if (e == buft) buft = ggml_backend_dev_buffer_type(cpu);
        }
        auto it = by_buft.find(buft);
        if (it == by_buft.end()) {
            ggml_init_params p = {/*mem_size =*/static_cast<size_t>(n) * ggml_tensor_overhead(), nullptr, true};
            it = by_buft.emplace(buft, std::unique_ptr<ggml_context, decltype(&ggml_free)>(ggml_init(p), &ggml_free))
                     .first;
        }
        ggml_dup_tensor(it->second.get(), ab.first);
        ggml_dup_tensor(it->second.get(), ab.second);
    }
    std::vector<BufferRow> rows;
    for (const auto & [buft, ctx] : by_buft) {
        BufferRow row;
        row.buffer_type = ggml_backend_buft_name(buft);
        ggml_backend_dev_t dev = ggml_backend_buft_get_device(buft);
        row.device = dev ? ggml_backend_dev_name(dev) : "CPU";
        row.host = ggml_backend_buft_is_host(buft);
        row.model = ggml_backend_alloc_ctx_tensors_from_buft_size(ctx.get(), buft);
        row.component = "lora";
        rows.push_back(row);
    }
    return rows;
}

}  // namespace pyllmrouter
