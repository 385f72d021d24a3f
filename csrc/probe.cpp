#include "probe.h"

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <tuple>

#include "ggml-backend.h"
#include "gguf.h"
#include "llama-ext.h"
#include "llama.h"

namespace pyllmrouter {
namespace {

void backend_init_once() {
    static std::once_flag once;
    std::call_once(once, [] { llama_backend_init(); });
}

const char * level_name(ggml_log_level level) {
    switch (level) {
        case GGML_LOG_LEVEL_ERROR: return "E";
        case GGML_LOG_LEVEL_WARN:  return "W";
        case GGML_LOG_LEVEL_INFO:  return "I";
        default:                   return "D";
    }
}

// llama.cpp has one process-wide log callback, and other threads (a model
// loading or generating in the same process) log through it while a probe
// runs.  So a routing callback is installed once: lines logged by a thread
// that is probing go to that probe's capture (thread-local), every other line
// goes on to the callback that was there before.
class LogCapture;
thread_local LogCapture * tl_capture = nullptr;

struct LogRoute {
    std::mutex mutex;
    ggml_log_callback prev_cb = nullptr;
    void * prev_ud = nullptr;
    // lines below this level end here: llama.cpp logs debug lines on every
    // decode, and the callback before this one may be Python's (the GIL each time)
    std::atomic<int> floor{GGML_LOG_LEVEL_NONE};
};

LogRoute & log_route() {
    static LogRoute route;
    return route;
}

thread_local ggml_log_level tl_level = GGML_LOG_LEVEL_INFO;  // of the line a CONT continues

void routed_log(ggml_log_level level, const char * text, void * user_data);

// Makes routed_log llama.cpp's callback (once, or again if someone replaced it);
// route.mutex held.
void install_route(LogRoute & route) {
    ggml_log_callback cb = nullptr;
    void * ud = nullptr;
    llama_log_get(&cb, &ud);
    if (cb != &routed_log) {
        route.prev_cb = cb;
        route.prev_ud = ud;
        llama_log_set(&routed_log, nullptr);
    }
}

// Collects the log lines ("E text", "W text", ...) of the current thread
// while alive.
class LogCapture {
  public:
    explicit LogCapture(bool forward = false) : forward_(forward) {
        LogRoute & route = log_route();
        std::lock_guard<std::mutex> lock(route.mutex);
        install_route(route);
        outer_ = tl_capture;
        tl_capture = this;
    }
    ~LogCapture() { tl_capture = outer_; }  // captures nest: an inner one takes its lines
    LogCapture(const LogCapture &) = delete;
    LogCapture & operator=(const LogCapture &) = delete;

    std::vector<std::string> take() {
        if (!partial_.empty()) {
            lines_.push_back(partial_);
            partial_.clear();
        }
        return std::move(lines_);
    }

    // The error lines, joined: the reason llama.cpp gave for a failure.
    std::string reason() const {
        std::string out;
        auto add = [&out](const std::string & line) {
            if (line.rfind("E ", 0) == 0) {
                if (!out.empty()) out += "; ";
                out += line.substr(2);
            }
        };
        for (const auto & line : lines_) add(line);
        add(partial_);
        return out.empty() ? std::string("llama.cpp gave no reason") : out;
    }

    void add(ggml_log_level level, const char * text) {
        if (partial_.empty()) {
            // a continuation keeps the level of the line it continues
            level_ = level == GGML_LOG_LEVEL_CONT ? level_ : level;
            partial_ = std::string(level_name(level_)) + " ";
        }
        for (const char * p = text; *p; ++p) {
            if (*p == '\n') {
                lines_.push_back(partial_);
                partial_.clear();
                if (p[1]) partial_ = std::string(level_name(level_)) + " ";
            } else {
                partial_ += *p;
            }
        }
    }

    bool forward() const { return forward_; }

  private:
    bool forward_;  // the lines also go on where they would have gone
    LogCapture * outer_ = nullptr;
    ggml_log_level level_ = GGML_LOG_LEVEL_INFO;
    std::string partial_;
    std::vector<std::string> lines_;
};

void routed_log(ggml_log_level level, const char * text, void * /*user_data*/) {
    if (tl_capture != nullptr) {
        tl_capture->add(level, text);
        if (!tl_capture->forward()) return;
    }
    if (level != GGML_LOG_LEVEL_CONT) tl_level = level;
    LogRoute & route = log_route();
    if (route.prev_cb != nullptr && tl_level >= route.floor.load(std::memory_order_relaxed)) {
        route.prev_cb(level, text, route.prev_ud);
    }
}

}  // namespace

std::vector<std::string> capture_log(const std::function<void()> & fn) {
    LogCapture capture;
    fn();
    return capture.take();
}

std::vector<std::string> tee_log(const std::function<void()> & fn) {
    LogCapture capture(/*forward =*/true);
    fn();
    return capture.take();
}

void route_log(int floor) {
    LogRoute & route = log_route();
    std::lock_guard<std::mutex> lock(route.mutex);
    route.floor.store(floor);
    install_route(route);
}

namespace {

std::string meta_str(const llama_model * model, const char * key) {
    char buf[256];
    int32_t n = llama_model_meta_val_str(model, key, buf, sizeof(buf));
    return n < 0 ? std::string() : std::string(buf);
}

ModelFacts facts_of(const llama_model * model) {
    ModelFacts f;
    f.architecture = meta_str(model, "general.architecture");
    f.name = meta_str(model, "general.name");
    f.n_layer = llama_model_n_layer(model);
    f.n_ctx_train = llama_model_n_ctx_train(model);
    f.n_embd = llama_model_n_embd(model);
    f.n_head = llama_model_n_head(model);
    f.n_expert = llama_model_n_expert(model);
    f.n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    f.n_params = llama_model_n_params(model);
    f.model_size = llama_model_size(model);
    for (int i = 0; i < llama_model_n_devices(model); ++i) {
        f.devices.emplace_back(ggml_backend_dev_name(llama_model_get_device(model, i)));
    }
    return f;
}

// Mirrors llama_context::output_reserve(): logits for every output row, plus an
// embedding per row when the context extracts embeddings. Host memory.
BufferRow output_row(const llama_model * model, const llama_context_params & cparams, std::uint32_t n_outputs) {
    const std::uint64_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    const std::uint64_t n_embd_out = llama_model_n_embd_out(model);
    const std::uint64_t rows = std::max<std::uint64_t>(n_outputs, cparams.n_seq_max);
    BufferRow row;
    row.buffer_type = "output";
    row.device = "CPU";
    row.host = true;
    row.output = (n_vocab * rows + (cparams.embeddings ? n_embd_out * rows : 0)) * sizeof(float);
    return row;
}

std::string device_type_name(enum ggml_backend_dev_type type) {
    switch (type) {
        case GGML_BACKEND_DEVICE_TYPE_CPU:   return "cpu";
        case GGML_BACKEND_DEVICE_TYPE_GPU:   return "gpu";
        case GGML_BACKEND_DEVICE_TYPE_IGPU:  return "igpu";
        case GGML_BACKEND_DEVICE_TYPE_ACCEL: return "accel";
        default:                             return "other";
    }
}

struct ModelFree { void operator()(llama_model * m) const { llama_model_free(m); } };
struct GgufFree { void operator()(gguf_context * g) const { gguf_free(g); } };

// The header of a GGUF file (no tensor data).
std::unique_ptr<gguf_context, GgufFree> open_header(const std::string & path) {
    LogCapture capture;
    gguf_init_params params = {/*no_alloc =*/true, /*ctx =*/nullptr};
    std::unique_ptr<gguf_context, GgufFree> g(gguf_init_from_file(path.c_str(), params));
    if (!g) {
        throw probe_error(path + ": not a readable GGUF file: " + capture.reason());
    }
    return g;
}
struct ContextFree { void operator()(llama_context * c) const { llama_free(c); } };

}  // namespace

std::vector<BufferRow> breakdown_of(const llama_context * ctx) {
    std::vector<BufferRow> rows;
    for (const auto & [buft, mb] : llama_get_memory_breakdown(ctx)) {
        BufferRow row;
        row.buffer_type = ggml_backend_buft_name(buft);
        ggml_backend_dev_t dev = ggml_backend_buft_get_device(buft);
        row.device = dev ? ggml_backend_dev_name(dev) : "CPU";
        row.host = ggml_backend_buft_is_host(buft);
        row.model = mb.model;
        row.context = mb.context;
        row.compute = mb.compute;
        rows.push_back(row);
    }
    return rows;
}

ProbeResult probe_file(const std::string & path, const llama_model_params & mparams,
                       const llama_context_params & cparams, std::uint32_t n_outputs,
                       const std::vector<std::string> & loras, std::uint32_t checkpoints) {
    backend_init_once();
    LogCapture capture;

    llama_model_params mp = mparams;
    mp.no_alloc = true;
    mp.load_mode = LLAMA_LOAD_MODE_NONE;  // the default mode with no_alloc aborts
    mp.progress_callback = nullptr;
    mp.progress_callback_user_data = nullptr;

    std::unique_ptr<llama_model, ModelFree> model(llama_model_load_from_file(path.c_str(), mp));
    if (!model) {
        throw probe_error(path + ": cannot load model: " + capture.reason());
    }
    std::vector<BufferRow> adapters;
    for (const auto & lora : loras) {
        const auto rows = lora_rows(model.get(), lora);
        adapters.insert(adapters.end(), rows.begin(), rows.end());
    }
    llama_context_params cp = cparams;
    cp.cb_eval = nullptr;
    cp.abort_callback = nullptr;
    std::unique_ptr<llama_context, ContextFree> ctx(llama_init_from_model(model.get(), cp));
    if (!ctx) {
        throw probe_error(path + ": cannot create a context: " + capture.reason());
    }

    ProbeResult result;
    result.rows = breakdown_of(ctx.get());
    result.rows.push_back(output_row(model.get(), cp, n_outputs));
    result.rows.insert(result.rows.end(), adapters.begin(), adapters.end());
    if (checkpoints > 0) {
        const std::uint64_t each = checkpoint_bytes(ctx.get(), cp);
        if (each > 0) {
            BufferRow row;
            row.buffer_type = "checkpoints";
            row.device = "CPU";
            row.host = true;
            row.checkpoints = each * checkpoints * llama_n_seq_max(ctx.get());
            result.rows.push_back(row);
        }
    }
    result.facts = facts_of(model.get());
    result.n_ctx = llama_n_ctx(ctx.get());
    result.n_seq_max = llama_n_seq_max(ctx.get());
    ctx.reset();
    model.reset();
    result.log = capture.take();
    return result;
}

bool write_vocab_free_header(const std::string & src, const std::string & dest) {
    ggml_context * meta = nullptr;
    gguf_init_params ip = {/*no_alloc =*/true, /*ctx =*/&meta};
    std::unique_ptr<gguf_context, decltype(&gguf_free)> in(gguf_init_from_file(src.c_str(), ip), &gguf_free);
    std::unique_ptr<ggml_context, decltype(&ggml_free)> tensors(meta, &ggml_free);
    if (!in || !meta) {
        return false;
    }
    const int64_t split = gguf_find_key(in.get(), "split.count");
    const int64_t tokens = gguf_find_key(in.get(), "tokenizer.ggml.tokens");
    const int64_t arch = gguf_find_key(in.get(), "general.architecture");
    if ((split >= 0 && gguf_get_val_u16(in.get(), split) > 1) || tokens < 0 || arch < 0 ||
        gguf_get_kv_type(in.get(), arch) != GGUF_TYPE_STRING) {
        return false;
    }
    std::error_code ec;
    const auto file_size = std::filesystem::file_size(src, ec);
    if (ec) {
        return false;
    }
    const size_t data_offset = gguf_get_data_offset(in.get());
    for (int64_t i = 0; i < gguf_get_n_tensors(in.get()); ++i) {
        if (data_offset + gguf_get_tensor_offset(in.get(), i) + gguf_get_tensor_size(in.get(), i) > file_size) {
            return false;
        }
    }
    const uint32_t n_tokens = static_cast<uint32_t>(gguf_get_arr_n(in.get(), tokens));
    const std::string vocab_size = std::string(gguf_get_val_str(in.get(), arch)) + ".vocab_size";

    std::unique_ptr<gguf_context, decltype(&gguf_free)> out(gguf_init_empty(), &gguf_free);
    gguf_set_kv(out.get(), in.get());
    for (int64_t i = gguf_get_n_kv(out.get()) - 1; i >= 0; --i) {
        const std::string key = gguf_get_key(out.get(), i);
        if (key.rfind("tokenizer.", 0) == 0) {
            gguf_remove_key(out.get(), key.c_str());
        }
    }
    gguf_set_val_str(out.get(), "tokenizer.ggml.model", "no_vocab");
    if (gguf_find_key(out.get(), vocab_size.c_str()) < 0) {
        gguf_set_val_u32(out.get(), vocab_size.c_str(), n_tokens);
    }
    for (ggml_tensor * t = ggml_get_first_tensor(meta); t != nullptr; t = ggml_get_next_tensor(meta, t)) {
        gguf_add_tensor(out.get(), t);
    }
    if (!gguf_write_to_file(out.get(), dest.c_str(), /*only_meta =*/true)) {
        return false;
    }
    const int64_t n = gguf_get_n_tensors(out.get());
    const size_t data = n > 0 ? gguf_get_tensor_offset(out.get(), n - 1) + gguf_get_tensor_size(out.get(), n - 1) : 0;
    // the data region starts at the header's size, padded to the alignment (a context
    // made in memory reports no data offset of its own)
    std::filesystem::resize_file(dest, gguf_get_meta_size(out.get()) + gguf_get_alignment(out.get()) + data, ec);
    if (ec) {
        std::filesystem::remove(dest, ec);
        return false;
    }
    return true;
}

std::vector<DeviceInfo> list_devices() {
    backend_init_once();
    std::vector<DeviceInfo> out;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        DeviceInfo info;
        info.index = static_cast<int>(i);
        info.name = ggml_backend_dev_name(dev);
        info.description = ggml_backend_dev_description(dev);
        info.type = device_type_name(ggml_backend_dev_type(dev));
        size_t free = 0, total = 0;
        ggml_backend_dev_memory(dev, &free, &total);
        info.free = free;
        info.total = total;
        out.push_back(info);
    }
    return out;
}

void * device_handle(const std::string & name) {
    backend_init_once();
    std::string known;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        if (name == ggml_backend_dev_name(dev)) return dev;
        known += std::string(known.empty() ? "" : ", ") + ggml_backend_dev_name(dev);
    }
    throw probe_error("unknown device '" + name + "' (devices here: " + known + ")");
}

void * buffer_type_handle(const std::string & name) {
    backend_init_once();
    std::string known;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        for (ggml_backend_buffer_type_t buft : {ggml_backend_dev_buffer_type(dev), ggml_backend_dev_host_buffer_type(dev)}) {
            if (!buft) continue;
            if (name == ggml_backend_buft_name(buft)) return buft;
            known += std::string(known.empty() ? "" : ", ") + ggml_backend_buft_name(buft);
        }
    }
    throw probe_error("unknown buffer type '" + name + "' (buffer types here: " + known + ")");
}

std::vector<std::pair<std::string, std::uint64_t>> tensor_sizes(const std::string & path) {
    auto header = open_header(path);
    gguf_context * g = header.get();
    std::vector<std::pair<std::string, std::uint64_t>> out;
    for (int64_t i = 0; i < gguf_get_n_tensors(g); ++i) {
        out.emplace_back(gguf_get_tensor_name(g, i), gguf_get_tensor_size(g, i));
    }
    return out;
}

std::vector<std::string> add_rpc_servers(const std::vector<std::string> & endpoints) {
    backend_init_once();
    ggml_backend_reg_t rpc = ggml_backend_reg_by_name("RPC");
    if (!rpc) {
        throw probe_error("this llama.cpp build has no RPC backend (build llama-cpp-python with -DGGML_RPC=ON)");
    }
    using add_server_t = ggml_backend_reg_t (*)(const char *);
    auto add_server = reinterpret_cast<add_server_t>(ggml_backend_reg_get_proc_address(rpc, "ggml_backend_rpc_add_server"));
    if (!add_server) {
        throw probe_error("the RPC backend has no ggml_backend_rpc_add_server");
    }
    std::vector<std::string> names;
    for (const auto & endpoint : endpoints) {
        const size_t before = ggml_backend_dev_count();
        ggml_backend_reg_t reg = add_server(endpoint.c_str());
        if (!reg) {
            throw probe_error("cannot attach rpc-server " + endpoint);
        }
        ggml_backend_register(reg);
        for (size_t i = before; i < ggml_backend_dev_count(); ++i) {
            names.emplace_back(ggml_backend_dev_name(ggml_backend_dev_get(i)));
        }
    }
    return names;
}

std::uint32_t n_ctx_train_of(const std::string & path) {
    using Key = std::tuple<std::string, std::uintmax_t, std::int64_t>;
    static std::mutex mutex;
    static std::map<Key, std::uint32_t> known;
    std::error_code ec;
    const auto size = std::filesystem::file_size(path, ec);
    if (ec) return 0;
    const auto mtime = std::filesystem::last_write_time(path, ec).time_since_epoch().count();
    if (ec) return 0;
    const Key key{path, size, static_cast<std::int64_t>(mtime)};
    {
        std::lock_guard<std::mutex> lock(mutex);
        if (auto it = known.find(key); it != known.end()) return it->second;
    }
    std::uint32_t n = 0;
    capture_log([&] {  // an unreadable file's complaint is the load's to make
        gguf_init_params params = {/*no_alloc =*/true, /*ctx =*/nullptr};
        std::unique_ptr<gguf_context, decltype(&gguf_free)> g(gguf_init_from_file(path.c_str(), params), &gguf_free);
        if (!g) return;
        const int64_t arch = gguf_find_key(g.get(), "general.architecture");
        if (arch < 0 || gguf_get_kv_type(g.get(), arch) != GGUF_TYPE_STRING) return;
        const std::string name = std::string(gguf_get_val_str(g.get(), arch)) + ".context_length";
        const int64_t id = gguf_find_key(g.get(), name.c_str());
        if (id < 0) return;
        switch (gguf_get_kv_type(g.get(), id)) {
            case GGUF_TYPE_UINT32: n = gguf_get_val_u32(g.get(), id); break;
            case GGUF_TYPE_INT32:  n = static_cast<std::uint32_t>(std::max(0, gguf_get_val_i32(g.get(), id))); break;
            case GGUF_TYPE_UINT64: n = static_cast<std::uint32_t>(gguf_get_val_u64(g.get(), id)); break;
            default: break;
        }
    });
    std::lock_guard<std::mutex> lock(mutex);
    known[key] = n;
    return n;
}

std::map<std::string, MetaValue> gguf_metadata(const std::string & path) {
    auto header = open_header(path);
    gguf_context * g = header.get();
    std::map<std::string, MetaValue> out;
    for (int64_t i = 0; i < gguf_get_n_kv(g); ++i) {
        const std::string key = gguf_get_key(g, i);
        switch (gguf_get_kv_type(g, i)) {
            case GGUF_TYPE_UINT8:   out[key] = {'i', std::to_string(gguf_get_val_u8(g, i))}; break;
            case GGUF_TYPE_INT8:    out[key] = {'i', std::to_string(gguf_get_val_i8(g, i))}; break;
            case GGUF_TYPE_UINT16:  out[key] = {'i', std::to_string(gguf_get_val_u16(g, i))}; break;
            case GGUF_TYPE_INT16:   out[key] = {'i', std::to_string(gguf_get_val_i16(g, i))}; break;
            case GGUF_TYPE_UINT32:  out[key] = {'i', std::to_string(gguf_get_val_u32(g, i))}; break;
            case GGUF_TYPE_INT32:   out[key] = {'i', std::to_string(gguf_get_val_i32(g, i))}; break;
            case GGUF_TYPE_UINT64:  out[key] = {'i', std::to_string(gguf_get_val_u64(g, i))}; break;
            case GGUF_TYPE_INT64:   out[key] = {'i', std::to_string(gguf_get_val_i64(g, i))}; break;
            case GGUF_TYPE_FLOAT32: out[key] = {'f', std::to_string(gguf_get_val_f32(g, i))}; break;
            case GGUF_TYPE_FLOAT64: out[key] = {'f', std::to_string(gguf_get_val_f64(g, i))}; break;
            case GGUF_TYPE_BOOL:    out[key] = {'b', gguf_get_val_bool(g, i) ? "1" : "0"}; break;
            case GGUF_TYPE_STRING:  out[key] = {'s', gguf_get_val_str(g, i)}; break;
            case GGUF_TYPE_ARRAY:   out[key] = {'a', std::to_string(gguf_get_arr_n(g, i))}; break;
            default: break;
        }
    }
    return out;
}

}  // namespace pyllmrouter
