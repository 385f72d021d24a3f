// PYBIND11_MODULE(_native): conversions, GIL release and exceptions only.
// The work lives in probe.cpp.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "ggml-backend.h"
#include "llama.h"
#include "build-info.h"
#include "conduit.h"
#include "engine.h"
#include "services.h"
#include "params.h"
#include "hub.h"
#include "probe.h"
#include "request_keys.inc"  // generated from the pinned source (cmake/request_keys.py)

namespace py = pybind11;
using namespace pyllmrouter;

namespace {

py::dict row_dict(const BufferRow & r) {
    py::dict d;
    d["buffer_type"] = r.buffer_type;
    d["device"] = r.device;
    d["host"] = r.host;
    d["model"] = r.model;
    d["context"] = r.context;
    d["compute"] = r.compute;
    d["output"] = r.output;
    d["projector"] = r.projector;
    d["checkpoints"] = r.checkpoints;
    d["component"] = r.component;
    return d;
}

// A Python callable held by C++ callbacks that may be copied and dropped on threads without
// the GIL: it is released with the GIL held, whoever drops the last copy.
struct PyCallable {
    py::object fn;
    explicit PyCallable(py::object f) : fn(std::move(f)) {}
    ~PyCallable() {
        py::gil_scoped_acquire acquire;
        fn = py::object();
    }
};

// {field name: (filename, content type, bytes)}: a multipart request's files
Files files_of(const py::dict & files) {
    Files out;
    for (const auto & [key, value] : files) {
        const auto t = value.cast<py::tuple>();
        out[key.cast<std::string>()] = UploadedFile{t[0].cast<std::string>(), t[1].cast<std::string>(),
                                                    std::string(t[2].cast<py::bytes>())};
    }
    return out;
}

// Engine::handle and Services::handle from Python: the body and files copied while the GIL
// is held, the handler run without it.
template <typename T>
std::shared_ptr<EngineReply> call_handler(T & target, const std::string & method, const std::string & path,
                                          const std::map<std::string, std::string> & query,
                                          const std::map<std::string, std::string> & headers, const py::bytes & body,
                                          const std::string & query_string, std::shared_ptr<StopFlag> stop,
                                          const py::dict & files) {
    std::string b = body;
    const Files f = files_of(files);
    py::gil_scoped_release release;
    return target.handle(method, path, query, headers, b, query_string, std::move(stop), f);
}

#define HANDLE_ARGS py::arg("method"), py::arg("path"), py::arg("query"), py::arg("headers"), py::arg("body"), \
    py::arg("query_string") = "", py::arg("stop") = nullptr, py::arg("files") = py::dict()

py::list rows_list(const std::vector<BufferRow> & rows) {
    py::list out;
    for (const auto & r : rows) out.append(row_dict(r));
    return out;
}

py::dict probe_dict(const ProbeResult & r);

py::dict probe(const std::string & path, std::uintptr_t model_params, std::uintptr_t context_params,
               std::uint32_t n_outputs) {
    if (model_params == 0 || context_params == 0) {
        throw py::value_error("model_params and context_params must be addresses of llama_cpp parameter structs");
    }
    const auto & mp = *reinterpret_cast<const llama_model_params *>(model_params);
    const auto & cp = *reinterpret_cast<const llama_context_params *>(context_params);
    ProbeResult r;
    {
        py::gil_scoped_release release;
        r = probe_file(path, mp, cp, n_outputs);
    }
    return probe_dict(r);
}

py::dict probe_dict(const ProbeResult & r) {
    py::dict facts;
    facts["architecture"] = r.facts.architecture;
    facts["name"] = r.facts.name;
    facts["n_layer"] = r.facts.n_layer;
    facts["n_ctx_train"] = r.facts.n_ctx_train;
    facts["n_embd"] = r.facts.n_embd;
    facts["n_head"] = r.facts.n_head;
    facts["n_expert"] = r.facts.n_expert;
    facts["n_vocab"] = r.facts.n_vocab;
    facts["n_params"] = r.facts.n_params;
    facts["model_size"] = r.facts.model_size;
    facts["devices"] = r.facts.devices;
    py::dict d;
    d["rows"] = rows_list(r.rows);
    d["facts"] = facts;
    d["n_ctx"] = r.n_ctx;
    d["n_seq_max"] = r.n_seq_max;
    d["log"] = r.log;
    return d;
}

py::list live_breakdown(std::uintptr_t ctx) {
    if (ctx == 0) throw py::value_error("ctx must be the address of a live llama_context");
    std::vector<BufferRow> rows;
    {
        py::gil_scoped_release release;
        rows = breakdown_of(reinterpret_cast<const llama_context *>(ctx));
    }
    return rows_list(rows);
}

py::list devices() {
    std::vector<DeviceInfo> devs;
    {
        py::gil_scoped_release release;
        devs = list_devices();
    }
    py::list out;
    for (const auto & d : devs) {
        py::dict x;
        x["index"] = d.index;
        x["name"] = d.name;
        x["description"] = d.description;
        x["type"] = d.type;
        x["free"] = d.free;
        x["total"] = d.total;
        out.append(x);
    }
    return out;
}

py::dict metadata(const std::string & path) {
    std::map<std::string, MetaValue> kv;
    {
        py::gil_scoped_release release;
        kv = gguf_metadata(path);
    }
    py::dict out;
    for (const auto & [key, value] : kv) {
        const auto & [kind, text] = value;
        switch (kind) {
            case 'i': out[py::str(key)] = py::int_(py::str(text)); break;
            case 'f': out[py::str(key)] = py::float_(std::stod(text)); break;
            case 'b': out[py::str(key)] = py::bool_(text == "1"); break;
            case 'a': out[py::str(key)] = py::make_tuple("array", std::stoll(text)); break;
            default:  out[py::str(key)] = py::str(text); break;
        }
    }
    return out;
}

void bind_engine(py::module_ & m) {
    py::class_<StopFlag, std::shared_ptr<StopFlag>>(m, "StopFlag", "Stops a request from any thread.")
        .def(py::init<>())
        .def("set", &StopFlag::set)
        .def_property_readonly("is_set", [](const StopFlag & f) { return f.value.load(); });
    py::class_<EngineReply, std::shared_ptr<EngineReply>>(m, "EngineReply",
                            "One reply of an Engine: status, headers and body, or a stream read by next().")
        .def_property_readonly("status", &EngineReply::status)
        .def_property_readonly("content_type", &EngineReply::content_type)
        .def_property_readonly("headers", &EngineReply::headers)
        .def_property_readonly("data", [](const EngineReply & r) { return py::bytes(r.data()); })
        .def_property_readonly("is_stream", &EngineReply::is_stream)
        .def_property_readonly("cut", &EngineReply::cut,
                               "Stopped before it was whole (no status earned): see engine.h.")
        .def("next", [](EngineReply & r) {
                 std::string chunk;
                 bool more;
                 {
                     py::gil_scoped_release release;
                     more = r.next(chunk);
                 }
                 return py::make_tuple(more, py::bytes(chunk));
             },
             "(more, chunk): the stream's next chunk; more is False once it has ended.")
        .def("cancel", &EngineReply::cancel, "Make the handler's should_stop true (a closed connection).");
    py::class_<Outbox, std::shared_ptr<Outbox>>(m, "Outbox",
                                                "Chunks of streamed replies, taken all at once by one reader.")
        .def(py::init<double>(), py::arg("interval") = 0.0,
             "Takes come at least interval seconds apart (the first after a pause at once).")
        .def("take", [](Outbox & o, double timeout) {
                 std::vector<Outbox::Item> items;
                 {
                     py::gil_scoped_release release;
                     items = o.take(timeout);
                 }
                 py::list out;
                 for (auto & it : items) {
                     out.append(py::make_tuple(it.req_id, py::bytes(it.chunk), it.last, it.cut));
                 }
                 return out;
             }, py::arg("timeout"),
             "[(req_id, chunk, last, cut)] queued, waiting up to timeout seconds for the first.")
        .def("push", [](Outbox & o, std::int64_t req_id, const py::bytes & chunk, bool last, bool cut) {
                 o.push({req_id, std::string(chunk), last, cut});
             }, py::arg("req_id"), py::arg("chunk"), py::arg("last") = false, py::arg("cut") = false,
             "Queue a chunk as a pump does.")
        .def("wake", [](Outbox & o) { o.push({-1, std::string(), true}); },
             "Wake the reader with an item of request id -1 (its signal to look at its state).");
    m.def("pump", &pump, py::arg("reply"), py::arg("req_id"), py::arg("outbox"),
          "Read a streamed reply to its end on a thread of its own, into the outbox.");
    py::class_<Conduit>(m, "Conduit",
                        "A worker's native data path: client connections the router hands over, answered by "
                        "the attached engines' llama-server handlers and written to the client's socket here.")
        .def(py::init<int>(), py::arg("fd"))
        .def("attach", &Conduit::attach, py::arg("name"), py::arg("engine"), py::arg("awaited") = 0,
             py::call_guard<py::gil_scoped_release>())
        .def("detach", &Conduit::detach, py::arg("name"), py::call_guard<py::gil_scoped_release>(),
             "No more requests for the model: those in flight stopped and waited for; its hits.")
        .def_property_readonly("in_flight", &Conduit::in_flight)
        .def("close", &Conduit::close, py::call_guard<py::gil_scoped_release>());
    py::class_<Engine, std::shared_ptr<Engine>>(m, "Engine",
                                                "llama.cpp's server engine for one model (llama-server without HTTP).")
        .def(py::init<const std::vector<std::string> &>(), py::arg("args"),
             "Parse llama-server arguments (ValueError names a bad one).")
        .def("load", [](Engine & e, py::object progress) {
                 std::function<void(const std::string &)> report;
                 if (!progress.is_none()) {
                     auto fn = std::make_shared<PyCallable>(std::move(progress));
                     report = [fn](const std::string & payload) {
                         py::gil_scoped_acquire acquire;
                         try {
                             fn->fn(payload);
                         } catch (py::error_already_set & err) {
                             err.discard_as_unraisable("Engine.load progress");
                         }
                     };
                 }
                 py::gil_scoped_release release;
                 e.load(report);
             }, py::arg("progress") = py::none(),
             "Load the model and start the slot loop (RuntimeError on failure); progress(json) gets "
             "llama-server's loading state as it goes.")
        .def("handle", &call_handler<Engine>, HANDLE_ARGS, "The reply of llama-server's handler for (method, path).")
        .def("close", &Engine::close, py::call_guard<py::gil_scoped_release>(),
             "End the slot loop and free the model and context.")
        .def("slot_file", &Engine::slot_file, py::arg("save"), py::arg("slot"), py::arg("path"),
             py::call_guard<py::gil_scoped_release>(),
             "Save (or restore) a slot's state to (from) path: the router's own keep store, out of any client's "
             "reach; llama-server's JSON result, or {\"error\": ...}.")
        .def("slot_state_size", &Engine::slot_state_size, py::arg("slot"),
             "The bytes of a slot's KV state (what a save writes beside its tokens), no request running.")
        .def("breakdown", [](const Engine & e) { return rows_list(e.breakdown()); },
             "The per-buffer-type breakdown of the engine's llama_context.")
        .def_property_readonly("n_parallel", &Engine::n_parallel)
        .def_property_readonly("n_ctx", &Engine::n_ctx);
    py::class_<Services>(m, "Services",
                         "llama-server's services beside its models: /tools (built-in tools, MCP servers) and "
                         "/cors-proxy, each llama-server's 403 when off.")
        .def(py::init([](const std::vector<std::string> & args) {
                 py::gil_scoped_release release;
                 return std::make_unique<Services>(args);
             }), py::arg("args"),
             "Parse llama-server arguments and start the MCP servers they name.")
        .def("handle", &call_handler<Services>, HANDLE_ARGS, "The reply of llama-server's handler for (method, path).")
        .def("close", &Services::close, py::call_guard<py::gil_scoped_release>(),
             "End the requests in flight and the MCP servers.");
    m.def("request_keys", [] { return std::vector<std::string>(std::begin(REQUEST_KEYS), std::end(REQUEST_KEYS)); },
          "The request keys llama-server's handlers read (its server sources and completion schema, "
          "at the pinned version).");
    m.def("router_settings", &router_settings, py::arg("args"),
          "JSON: what llama-server's HTTP layer makes of these arguments (CORS, API keys, tools, MCP, proxy).");
    m.def("probe_server", [](const std::vector<std::string> & args, bool vocab_free) {
              ProbeResult r;
              {
                  py::gil_scoped_release release;
                  r = probe_server(args, vocab_free);
              }
              return probe_dict(r);
          }, py::arg("args"), py::arg("vocab_free") = true,
          "probe() of what llama-server's engine allocates for these arguments (ValueError: bad arguments).");
    m.def("write_vocab_free_header", [](const std::string & src, const std::string & dest) {
              py::gil_scoped_release release;
              return write_vocab_free_header(src, dest);
          }, py::arg("src"), py::arg("dest"),
          "Write the header of src without its vocabulary's content to dest (see probe.h); False if it does not apply.");
    m.def("preset_args", &preset_args, py::arg("keys"),
          "llama-server preset (key, value) pairs as the arguments its router passes a child; "
          "ValueError names an unknown key.");
    m.def("preset_model", [](const std::vector<std::pair<std::string, std::string>> & keys) {
              const PresetModel p = preset_model(keys);
              py::dict d;
              d["args"] = p.args;
              d["model"] = p.model;
              d["devices"] = p.has_devices ? py::cast(p.devices) : py::none();
              d["draft_devices"] = p.has_draft_devices ? py::cast(p.draft_devices) : py::none();
              d["aliases"] = p.aliases;
              d["hf_repo"] = p.hf_repo;
              d["hf_file"] = p.hf_file;
              return d;
          }, py::arg("keys"),
          "A preset section's keys: {args, model, devices, draft_devices, aliases} (the model file, the "
          "device lists and the aliases taken out of the arguments); ValueError names an unknown key.");
    m.def("llama_fit", [](const std::vector<std::string> & args,
                          const std::vector<std::pair<std::string, std::uint64_t>> & rooms) {
              PeerFit f;
              {
                  py::gil_scoped_release release;
                  f = llama_fit(args, rooms);
              }
              py::dict d;
              d["status"] = f.status;
              d["n_ctx"] = f.n_ctx;
              d["n_gpu_layers"] = f.n_gpu_layers;
              d["tensor_split"] = f.tensor_split;
              d["overrides"] = f.overrides;
              d["seconds"] = f.seconds;
              d["log"] = f.log;
              return d;
          }, py::arg("args"), py::arg("rooms"),
          "llama.cpp's own fit (common_fit_params) of these llama-server arguments on devices with exactly "
          "the room given, [(device, bytes)] ('CPU': the host alone): {status, n_ctx, n_gpu_layers, "
          "tensor_split, overrides, seconds, log}.");
    m.def("cached_models", [] {
              std::vector<CachedModel> models;
              {
                  py::gil_scoped_release release;
                  models = cached_models();
              }
              py::list out;
              for (const auto & c : models) {
                  py::dict d;
                  d["name"] = c.name;
                  d["path"] = c.path;
                  d["mmproj"] = c.mmproj;
                  d["error"] = c.error;
                  out.append(d);
              }
              return out;
          }, "Every model in llama.cpp's cache (-hf downloads): [{name, path, mmproj, error}], resolved offline.");
    m.def("download_model", [](const std::string & name, py::function progress, const std::string & hf_file) {
              py::gil_scoped_release release;
              return download_model(name, [&progress](const std::string & url, std::uint64_t done, std::uint64_t total) {
                  py::gil_scoped_acquire acquire;
                  py::object go_on = progress(url, done, total);
                  return go_on.is_none() || go_on.cast<bool>();
              }, hf_file);
          }, py::arg("name"), py::arg("progress"), py::arg("hf_file") = "",
          "Download org/repo[:tag] into llama.cpp's cache with llama.cpp's downloader; progress(url, done, total) "
          "as it goes (False: cancel; the partial file is removed); returns the model's path (RuntimeError names "
          "the reason).");
    m.def("remove_cached", &remove_cached, py::arg("name"), "Remove org/repo[:tag] from llama.cpp's cache.");
    m.def("resolve_cached", [](const std::string & repo, const std::string & file) {
              CachedModel c;
              {
                  py::gil_scoped_release release;
                  c = resolve_cached(repo, file);
              }
              py::dict d;
              d["path"] = c.path;
              d["mmproj"] = c.mmproj;
              return d;
          }, py::arg("hf_repo"), py::arg("hf_file") = "",
          "A model of llama.cpp's cache resolved offline, as llama-server resolves -hf [--hf-file]: {path, mmproj}.");
    m.def("args_to_preset", &args_to_preset, py::arg("args"),
          "A llama-server command line as preset (key, value) pairs, as llama.cpp's preset machinery reads it.");
    m.def("preset_hf_paths", &preset_hf_paths, py::arg("keys"),
          "The cache files a preset's model and draft repositories resolve to, as llama-server's router "
          "resolves them for dedup-cache-models.");
    m.def("model_base_args", &model_base_args, py::arg("args"),
          "The router's llama-server arguments as llama-server's router lays them over every model: "
          "without the router's own options (TLS, API keys, model sources, a model's file and alias).");
    m.def("cache_dir", &cache_dir, "Where llama.cpp's cache of downloads is.");
    m.def("build_info", [] { return std::string(llama_build_info()); }, "llama.cpp's build (llama-server's build_info).");
    m.def("server_params", [](const std::vector<std::string> & args) {
              ServerParams p;
              {
                  py::gil_scoped_release release;
                  p = server_params(args);
              }
              py::dict d;
              d["model"] = p.model;
              d["hf_repo"] = p.hf_repo;
              d["n_ctx"] = p.n_ctx;
              d["ctx_auto"] = p.ctx_auto;
              d["n_ctx_train"] = p.n_ctx_train;
              d["fit"] = p.fit;
              d["fit_ctx"] = p.fit_ctx;
              d["n_parallel"] = p.n_parallel;
              d["kv_unified"] = p.kv_unified;
              d["n_streams"] = p.n_streams;
              d["n_batch"] = p.n_batch;
              d["n_ubatch"] = p.n_ubatch;
              d["swa_full"] = p.swa_full;
              d["type_k"] = p.type_k;
              d["type_v"] = p.type_v;
              d["flash_attn"] = p.flash_attn;
              d["n_gpu_layers"] = p.n_gpu_layers;
              d["mmproj"] = p.mmproj;
              d["mmproj_offload"] = p.mmproj_offload;
              d["draft"] = p.draft;
              d["draft_n_gpu_layers"] = p.draft_n_gpu_layers;
              d["lora"] = p.lora;
              d["cache_ram"] = p.cache_ram;
              d["ctx_checkpoints"] = p.ctx_checkpoints;
              d["embedding"] = p.embedding;
              d["slot_save_path"] = p.slot_save_path;
              return d;
          }, py::arg("args"),
          "What llama-server makes of these arguments, as far as memory goes: its own defaults and "
          "post-parse rules, and the context its fit starts from (ValueError: bad arguments).");
}

}  // namespace

PYBIND11_MODULE(_native, m) {
    m.doc() = "pyllmrouter's native probe over the libllama that llama_cpp loads";
    py::register_exception<probe_error>(m, "LlamaError", PyExc_RuntimeError);
    m.def("probe", &probe, py::arg("path"), py::arg("model_params"), py::arg("context_params"),
          py::arg("n_outputs"),
          "Build model + context with no_alloc from the given llama_cpp parameter structs "
          "(addresses); return the per-buffer-type breakdown, model facts and the log.");
    m.def("live_breakdown", &live_breakdown, py::arg("ctx"),
          "The per-buffer-type breakdown of a live llama_context (its address).");
    m.def("route_log", &route_log, py::arg("floor"),
          "Pass on to the log callback installed before only lines of this ggml_log_level or above.");
    m.def("devices", &devices, "Every ggml backend device with free and total bytes.");
    m.def("metadata", &metadata, py::arg("path"),
          "Scalar GGUF metadata (arrays as ('array', length)), read without tensor data.");
    m.def("device_handle", [](const std::string & name) { return reinterpret_cast<std::uintptr_t>(device_handle(name)); },
          py::arg("name"), "Address of the ggml device with this name (for llama_model_params.devices).");
    m.def("buffer_type_handle", [](const std::string & name) { return reinterpret_cast<std::uintptr_t>(buffer_type_handle(name)); },
          py::arg("name"), "Address of the ggml buffer type with this name (for tensor overrides).");
    m.def("tensor_sizes", [](const std::string & path) {
              py::gil_scoped_release release;
              return tensor_sizes(path);
          }, py::arg("path"), "(name, bytes) of every tensor, read from the GGUF header.");
    m.def("add_rpc_servers", [](const std::vector<std::string> & endpoints) {
              py::gil_scoped_release release;
              return add_rpc_servers(endpoints);
          }, py::arg("endpoints"), "Attach rpc-servers (host:port) as devices; returns the device names added.");
    m.def("buffer_type_name", [](std::uintptr_t buft) {
              if (buft == 0) throw py::value_error("null buffer type");
              return std::string(ggml_backend_buft_name(reinterpret_cast<ggml_backend_buffer_type_t>(buft)));
          }, py::arg("buft"), "Name of a ggml buffer type (its address).");
    m.def("device_buffer_type", [](const std::string & name) {
              auto * dev = static_cast<ggml_backend_dev_t>(device_handle(name));
              return std::string(ggml_backend_buft_name(ggml_backend_dev_buffer_type(dev)));
          }, py::arg("name"), "Name of a device's own buffer type (for tensor overrides).");
    bind_engine(m);
    m.def("max_devices", &llama_max_devices);
    m.def("max_tensor_buft_overrides", &llama_max_tensor_buft_overrides);
}
