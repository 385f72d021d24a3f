// llama.cpp's server engine for one model: see engine.h.
#include "engine.h"
#include "params.h"

#include <poll.h>
#include <stdlib.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <future>
#include <mutex>
#include <optional>
#include <utility>

#include "common.h"
#include "log.h"
#include "mtmd.h"
#include "server-common.h"
#include "server-context.h"
#include "server-http.h"
#include "server-stream.h"
#include "speculative.h"

namespace pyllmrouter {
namespace {

using handler_ptr = server_http_context::handler_t server_routes::*;

// (method, path) -> the handler llama-server's server.cpp registers for it.
// Paths with ":name" segments bind that segment to params[name].
const std::vector<std::pair<std::string, handler_ptr>> & route_table() {
    static const std::vector<std::pair<std::string, handler_ptr>> table = {
        {"GET /health", &server_routes::get_health},
        {"GET /v1/health", &server_routes::get_health},
        {"GET /metrics", &server_routes::get_metrics},
        {"GET /props", &server_routes::get_props},
        {"POST /props", &server_routes::post_props},
        {"GET /models", &server_routes::get_models},
        {"GET /v1/models", &server_routes::get_models},
        {"POST /completion", &server_routes::post_completions},
        {"POST /completions", &server_routes::post_completions},
        {"POST /v1/completions", &server_routes::post_completions_oai},
        {"POST /chat/completions", &server_routes::post_chat_completions},
        {"POST /v1/chat/completions", &server_routes::post_chat_completions},
        {"POST /v1/chat/completions/control", &server_routes::post_control},
        {"POST /v1/responses", &server_routes::post_responses_oai},
        {"POST /responses", &server_routes::post_responses_oai},
        {"POST /v1/audio/transcriptions", &server_routes::post_transcriptions_oai},
        {"POST /audio/transcriptions", &server_routes::post_transcriptions_oai},
        {"POST /v1/messages", &server_routes::post_anthropic_messages},
        {"POST /v1/messages/count_tokens", &server_routes::post_anthropic_count_tokens},
        {"POST /infill", &server_routes::post_infill},
        {"POST /embedding", &server_routes::post_embeddings},
        {"POST /embeddings", &server_routes::post_embeddings},
        {"POST /v1/embeddings", &server_routes::post_embeddings_oai},
        {"POST /rerank", &server_routes::post_rerank},
        {"POST /reranking", &server_routes::post_rerank},
        {"POST /v1/rerank", &server_routes::post_rerank},
        {"POST /v1/reranking", &server_routes::post_rerank},
        {"POST /tokenize", &server_routes::post_tokenize},
        {"POST /detokenize", &server_routes::post_detokenize},
        {"POST /apply-template", &server_routes::post_apply_template},
        {"POST /chat/completions/input_tokens", &server_routes::post_chat_completions_tok},
        {"POST /v1/chat/completions/input_tokens", &server_routes::post_chat_completions_tok},
        {"POST /responses/input_tokens", &server_routes::post_responses_tok_oai},
        {"POST /v1/responses/input_tokens", &server_routes::post_responses_tok_oai},
        {"GET /lora-adapters", &server_routes::get_lora_adapters},
        {"POST /lora-adapters", &server_routes::post_lora_adapters},
        {"GET /slots", &server_routes::get_slots},
        {"POST /slots/:id_slot", &server_routes::post_slots},
    };
    return table;
}

// The resumable stream routes (llama-server's server.cpp wires them for a model's own
// server): their sessions are the process's, whichever model's engine answers.
const std::map<std::string, server_http_context::handler_t> & stream_routes() {
    static const std::map<std::string, server_http_context::handler_t> table = {
        {"GET /v1/stream", server_stream_make_get_handler()},
        {"POST /v1/streams/lookup", server_stream_make_lookup_handler()},
        {"DELETE /v1/stream", server_stream_make_delete_handler()},
    };
    return table;
}

// Does "METHOD /a/:x" match (method, path)? Binds ":x" segments into params.
bool match(const std::string & pattern, const std::string & key, std::map<std::string, std::string> & params) {
    size_t i = 0, j = 0;
    std::map<std::string, std::string> bound;
    while (i < pattern.size() && j < key.size()) {
        if (pattern[i] == ':' && i > 0 && pattern[i - 1] == '/') {
            size_t pe = pattern.find('/', i);
            size_t ke = key.find('/', j);
            if (pe == std::string::npos) pe = pattern.size();
            if (ke == std::string::npos) ke = key.size();
            if (ke == j) return false;
            bound[pattern.substr(i + 1, pe - i - 1)] = key.substr(j, ke - j);
            i = pe;
            j = ke;
            continue;
        }
        if (pattern[i] != key[j]) return false;
        ++i;
        ++j;
    }
    if (i != pattern.size() || j != key.size()) return false;
    for (auto & [k, v] : bound) params[k] = v;
    return true;
}

// The reply llama-server's ex_wrapper makes of an exception.
std::unique_ptr<server_http_res> error_reply(const std::string & message, error_type type) {
    auto res = std::make_unique<server_http_res>();
    json err = format_error_response(message, type);
    res->status = json_value(err, "code", 500);
    res->data = safe_json_to_str({{"error", err}});
    return res;
}

error_type error_type_named(const std::string & name) {
    static const std::map<std::string, error_type> types = {
        {"invalid_request", ERROR_TYPE_INVALID_REQUEST}, {"authentication", ERROR_TYPE_AUTHENTICATION},
        {"server", ERROR_TYPE_SERVER}, {"not_found", ERROR_TYPE_NOT_FOUND}, {"permission", ERROR_TYPE_PERMISSION},
        {"unavailable", ERROR_TYPE_UNAVAILABLE}, {"not_supported", ERROR_TYPE_NOT_SUPPORTED},
    };
    const auto it = types.find(name);
    return it != types.end() ? it->second : ERROR_TYPE_SERVER;
}

std::once_flag process_once;

// Once per process: what llama-server's main does before any model.
void init_process() {
    std::call_once(process_once, [] {
        server_stream_session_manager_start();
    });
}

}  // namespace

// A file the engine would open beside the model: it exists and is a GGUF, or a
// probe_error "PATH: KIND: why" (the convention of every probe error: the file at
// fault first, so that the error names it).
static void require_gguf(const std::string & path, const char * kind) {
    std::FILE * f = std::fopen(path.c_str(), "rb");
    if (f == nullptr) {
        throw probe_error(path + ": " + kind + ": file not found or not readable");
    }
    char magic[4] = {0, 0, 0, 0};
    const size_t n = std::fread(magic, 1, 4, f);
    std::fclose(f);
    if (n != 4 || std::string(magic, 4) != "GGUF") {
        throw probe_error(path + ": " + kind + ": not a GGUF file");
    }
}

// The multimodal projector's bytes per device, as llama.cpp counts them for its own
// fit (mtmd_get_memory_usage: weights and the compute buffer of a warm-up image),
// with the mtmd_context_params server_context::load_model builds from the same params.
static std::vector<BufferRow> projector_rows(const common_params & params) {
    const std::string & path = params.mmproj.path;
    mtmd_context_params mparams = mtmd_context_params_default();
    mparams.use_gpu = params.mmproj_use_gpu;
    mparams.device = params.mmproj_device;
    mparams.print_timings = false;
    mparams.n_threads = params.cpuparams.n_threads;
    mparams.flash_attn_type = params.flash_attn_type;
    mparams.warmup = params.warmup;
    mparams.image_min_tokens = params.image_min_tokens;
    mparams.image_max_tokens = params.image_max_tokens;
    mparams.batch_max_tokens = params.mtmd_batch_max_tokens;
    mparams.media_marker = get_media_marker();
    const auto usage = mtmd_get_memory_usage(path.c_str(), mparams);
    if (usage.empty()) {
        throw probe_error(path + ": projector: llama.cpp cannot load it as a projector");
    }
    std::vector<BufferRow> rows;
    for (const auto & [dev, bytes] : usage) {
        BufferRow row;
        row.buffer_type = ggml_backend_buft_name(ggml_backend_dev_buffer_type(dev));
        row.device = ggml_backend_dev_name(dev);
        row.host = ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU;
        row.projector = bytes;
        row.component = "projector";
        rows.push_back(row);
    }
    return rows;
}

// probe_file of `path`, or with vocab_free of a copy of its header without the
// vocabulary's content (a tokenizer costs time, not memory); the real file where the
// copy does not apply or fails, so that errors name the real path.  The log lines of
// making the copy go with the probe's.
static ProbeResult probe_path(const std::string & path, const llama_model_params & mp, const llama_context_params & cp,
                              std::uint32_t n_outputs, bool vocab_free, const std::vector<std::string> & loras = {},
                              std::uint32_t checkpoints = 0) {
    std::vector<std::string> copy_log;
    std::optional<ProbeResult> result;
    if (vocab_free) {
        // a name no one can have chosen beforehand, made by this process alone (O_EXCL)
        std::string copy = (std::filesystem::temp_directory_path() / "pyllmrouter-probe-XXXXXX.gguf").string();
        const int fd = ::mkstemps(copy.data(), 5);
        if (fd >= 0) {
            ::close(fd);
            bool copied = false;
            copy_log = capture_log([&] { copied = write_vocab_free_header(path, copy); });
            if (copied) {
                try {
                    result = probe_file(copy, mp, cp, n_outputs, loras, checkpoints);
                } catch (const probe_error &) {
                    // the real file gives the real error, naming the real path
                }
            }
            std::error_code ec;
            std::filesystem::remove(copy, ec);
        }
    }
    if (!result) {
        result = probe_file(path, mp, cp, n_outputs, loras, checkpoints);
    }
    result->log.insert(result->log.begin(), copy_log.begin(), copy_log.end());
    return std::move(*result);
}

// The draft model and its context, as server_context::load_model makes them
// (common_speculative_init_result): the params common_base_params_to_speculative
// derives, a context of n_ctx cells (the target's), no recurrent-state sequences.
static ProbeResult probe_draft(const common_params & params, std::uint32_t n_ctx, bool vocab_free) {
    common_params draft = common_base_params_to_speculative(params);
    const llama_model_params dmp = common_model_params_to_llama(draft);
    llama_context_params dcp = common_context_params_to_llama(draft);
    dcp.n_ctx = n_ctx;
    dcp.n_rs_seq = 0;
    const std::string & path = draft.model.path;
    try {
        return probe_path(path, dmp, dcp, static_cast<std::uint32_t>(draft.n_outputs_max), vocab_free);
    } catch (const probe_error & e) {
        std::string reason = e.what();
        if (reason.rfind(path + ": ", 0) == 0) reason.erase(0, path.size() + 2);
        throw probe_error(path + ": draft: " + reason);
    }
}

// The projector, the model and the draft are measured at once, each on its own
// thread with its own log capture: they are independent loads (llama.cpp's
// thread-safety test loads models side by side), and the probe's wall time is what
// admission waits for.  The draft's context is as long as the target's: the length the
// arguments ask (-c N) while the target is built, measured again after it where the
// target's came out otherwise (-c 0, padding).  Errors are reported in a fixed order:
// projector, model, draft.  (A future of std::async joins its thread when it goes.)
ProbeResult probe_server(const std::vector<std::string> & args, bool vocab_free) {
    common_params params = parse_server_args(args);
    const llama_model_params mp = common_model_params_to_llama(params);
    const llama_context_params cp = common_context_params_to_llama(params);
    const bool has_projector = !params.mmproj.path.empty();
    const bool has_draft = params.speculative.has_dft();
    std::vector<std::string> loras;
    if (has_projector) require_gguf(params.mmproj.path, "projector");
    for (const auto & lora : params.lora_adapters) {
        require_gguf(lora.path, "lora");
        loras.push_back(lora.path);
    }
    if (has_draft) require_gguf(params.speculative.draft.mparams.path, "draft");

    std::future<std::pair<std::vector<BufferRow>, std::vector<std::string>>> projector;
    if (has_projector) {
        projector = std::async(std::launch::async, [&params] {
            std::vector<BufferRow> rows;
            auto log = capture_log([&] { rows = projector_rows(params); });
            return std::make_pair(std::move(rows), std::move(log));
        });
    }
    const std::uint32_t draft_ctx = cp.n_ctx;  // 0: the target's training context, known once it is built
    std::future<ProbeResult> draft;
    if (has_draft && draft_ctx > 0) {
        draft = std::async(std::launch::async, [&params, draft_ctx, vocab_free] {
            return probe_draft(params, draft_ctx, vocab_free);
        });
    }
    std::optional<ProbeResult> model;
    std::exception_ptr model_error;
    try {
        model = probe_path(params.model.path, mp, cp, static_cast<std::uint32_t>(params.n_outputs_max), vocab_free,
                           loras, static_cast<std::uint32_t>(std::max(0, params.n_ctx_checkpoints)));
    } catch (...) {
        model_error = std::current_exception();
    }
    if (projector.valid()) {
        auto [rows, log] = projector.get();  // a bad projector is the first error
        if (model) {
            model->rows.insert(model->rows.end(), rows.begin(), rows.end());
            model->log.insert(model->log.end(), log.begin(), log.end());
        }
    }
    if (model_error) std::rethrow_exception(model_error);
    ProbeResult result = std::move(*model);
    if (has_draft) {
        ProbeResult d = draft.valid() && draft_ctx == result.n_ctx ? draft.get()
                                                                   : probe_draft(params, result.n_ctx, vocab_free);
        for (auto & row : d.rows) {
            row.component = "draft";
            result.rows.push_back(row);
        }
        result.log.insert(result.log.end(), d.log.begin(), d.log.end());
    }
    return result;
}

// -- EngineReply ------------------------------------------------------------

bool StopFlag::peer_gone() const {
    if (peer < 0) return false;
    pollfd pfd{peer, POLLRDHUP, 0};  // the client shut its side, or the socket is in error
    return ::poll(&pfd, 1, 0) > 0 && (pfd.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

struct EngineCore : ReplyOwner {
    explicit EngineCore(common_params p) : params(std::move(p)), routes(params, ctx) {}
    common_params params;
    server_context ctx;
    server_routes routes;
};

EngineReply::EngineReply(std::shared_ptr<ReplyOwner> owner, std::map<std::string, std::string> params,
                         std::map<std::string, std::string> headers, std::string path, std::string query,
                         std::string body, std::shared_ptr<StopFlag> stop, const Files & files)
    : owner_(std::move(owner)),
      stop_(stop ? std::move(stop) : std::make_shared<StopFlag>()),
      should_stop_([this] { return stop_->stopped() || (owner_ && owner_->closing.load()); }) {
    std::map<std::string, uploaded_file> uploaded;
    for (const auto & [key, f] : files) {
        uploaded[key] = uploaded_file{raw_buffer(f.data.begin(), f.data.end()), f.filename, f.content_type};
    }
    req_.reset(new server_http_req{std::move(params), std::move(headers), std::move(path), std::move(query),
                                   std::move(body), std::move(uploaded), should_stop_});
}

void EngineReply::respond(const Handler & handler) {
    if (!handler) {
        res_ = error_reply("File Not Found", ERROR_TYPE_NOT_FOUND);
        return;
    }
    try {
        res_ = handler(*req_);
    } catch (const std::invalid_argument & e) {
        res_ = error_reply(e.what(), ERROR_TYPE_INVALID_REQUEST);
    } catch (const std::exception & e) {
        res_ = error_reply(e.what(), ERROR_TYPE_SERVER);
    }
    if (!res_) {
        res_ = error_reply("empty response from handler", ERROR_TYPE_SERVER);
    }
    // llama.cpp's handlers return their reply untouched where should_stop ended the wait
    // (server-context.cpp: "connection is closed"): every reply they make has a body.  Such a
    // reply is answered as llama-server answers a model that is not ready (a client still
    // there was stopped by an unload or a close; one gone reads nothing)
    if (!res_->is_stream() && res_->data.empty() && should_stop_()) {
        cut_ = true;
        res_ = error_reply("Loading model", ERROR_TYPE_UNAVAILABLE);
        res_->headers["Retry-After"] = "1";
    }
}

void EngineReply::fail(const std::string & message, const std::string & type) {
    res_ = error_reply(message, error_type_named(type));
}

EngineReply::~EngineReply() {
    if (res_) {
        stop_->set();
        res_->on_complete();
    }
    res_.reset();
    req_.reset();
}

int EngineReply::status() const { return res_->status; }
const std::string & EngineReply::content_type() const { return res_->content_type; }
const std::map<std::string, std::string> & EngineReply::headers() const { return res_->headers; }
const std::string & EngineReply::data() const { return res_->data; }
bool EngineReply::is_stream() const { return res_->is_stream(); }

bool EngineReply::next(std::string & chunk) {
    chunk.clear();
    if (ended_ || !res_->is_stream()) {
        ended_ = true;
        return false;
    }
    try {
        // llama.cpp's stream looks at should_stop before anything else: stopped before the
        // call, it ends there (cut); ended with nothing while stopped after, a stop too
        // (its own end gives "[DONE]", or nothing for formats without one: a race alone)
        const bool stopped = should_stop_();
        ended_ = !res_->next(chunk);
        cut_ = ended_ && (stopped || (chunk.empty() && should_stop_()));
    } catch (const std::exception & e) {
        chunk = "error: " + safe_json_to_str({{"error", format_error_response(e.what(), ERROR_TYPE_SERVER)}}) +
                "\n\n";
        ended_ = true;
    }
    return !ended_;
}

// -- Outbox and pumps ------------------------------------------------------

Outbox::Outbox(double interval_s)
    : interval_(std::chrono::duration_cast<std::chrono::steady_clock::duration>(
          std::chrono::duration<double>(interval_s))) {}

void Outbox::push(Item item) {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        items_.push_back(std::move(item));
    }
    cv_.notify_one();
}

std::vector<Outbox::Item> Outbox::take(double timeout_s) {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), [this] { return !items_.empty(); });
    if (items_.empty()) return {};
    const auto due = last_take_ + interval_;
    if (std::chrono::steady_clock::now() < due) {  // what comes meanwhile leaves with it
        lock.unlock();
        std::this_thread::sleep_until(due);
        lock.lock();
    }
    std::vector<Item> out;
    out.swap(items_);
    last_take_ = std::chrono::steady_clock::now();
    return out;
}

void pump(std::shared_ptr<EngineReply> reply, std::int64_t req_id, std::shared_ptr<Outbox> out) {
    std::thread([reply = std::move(reply), req_id, out = std::move(out)]() mutable {
        std::string chunk;
        bool more = true;
        while (more) {
            more = reply->next(chunk);
            if (!chunk.empty()) out->push({req_id, std::move(chunk), false});
            chunk = std::string();
        }
        const bool cut = reply->cut();
        reply.reset();  // on_complete, as llama-server's connection ends, before the last item
        out->push({req_id, std::string(), true, cut});
    }).detach();
}

// -- Engine -----------------------------------------------------------------

Engine::Engine(const std::vector<std::string> & args) {
    common_params params = parse_server_args(args);
    params.fit_params = false;  // the router fits (and gives the engine the result); the context is resolved
    init_process();
    n_parallel_ = params.n_parallel;
    n_ctx_ = params.n_ctx;
    timeout_write_ = params.timeout_write;
    core_ = std::make_shared<EngineCore>(std::move(params));
}

Engine::~Engine() { close(); }

std::shared_ptr<EngineCore> Engine::current() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return loaded_ ? core_ : nullptr;
}

void Engine::load(const std::function<void(const std::string &)> & progress) {
    std::shared_ptr<EngineCore> core;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        if (loaded_) return;
        core = core_;
    }
    if (!core) throw std::runtime_error("engine is closed");
    if (progress) {  // what llama-server's router hears from its child as it loads
        core->ctx.set_state_callback([progress](server_state state, json payload) {
            if (state == SERVER_STATE_LOADING) progress(safe_json_to_str(payload));
        });
    }
    bool ok = false;
    // what llama.cpp logged while it failed says why (a device out of memory: its buffer and size)
    const std::vector<std::string> log = tee_log([&] { ok = core->ctx.load_model(core->params); });
    if (!ok) {
        std::string why;
        for (const auto & line : log) {
            std::string l = line;
            while (!l.empty() && (l.back() == '\n' || l.back() == ' ')) l.pop_back();
            std::string low = l;
            for (auto & c : low) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
            if (low.find("alloc") != std::string::npos || low.find("memory") != std::string::npos ||
                low.find("failed") != std::string::npos || low.find("error") != std::string::npos) {
                why += "; " + l;
            }
        }
        throw std::runtime_error("llama.cpp could not load model " + core->params.model.path + why);
    }
    core->ctx.set_state_callback([](server_state, json) {});  // the caller's progress ends with the load
    core->routes.update_meta(core->ctx);
    if (const llama_context * lctx = core->ctx.get_llama_context()) n_ctx_ = static_cast<int>(llama_n_ctx(lctx));
    server_context * ctx = &core->ctx;
    loop_ended_.store(false);
    loop_ = std::thread([this, ctx] {
        ctx->start_loop();
        loop_ended_.store(true);
    });
    std::lock_guard<std::mutex> lock(mutex_);
    loaded_ = true;
}

std::shared_ptr<EngineReply> Engine::handle(const std::string & method, const std::string & path,
                                            const std::map<std::string, std::string> & query,
                                            const std::map<std::string, std::string> & headers,
                                            const std::string & body, const std::string & query_string,
                                            std::shared_ptr<StopFlag> stop, const Files & files) {
    std::map<std::string, std::string> params = query;
    const std::string key = method + " " + path;
    handler_ptr handler = nullptr;
    for (const auto & [pattern, h] : route_table()) {
        if (match(pattern, key, params)) {
            handler = h;
            break;
        }
    }
    const auto stream_route = stream_routes().find(key);
    const bool routed = handler != nullptr || stream_route != stream_routes().end();
    std::shared_ptr<EngineCore> core = current();
    auto reply = std::make_shared<EngineReply>(core, std::move(params), headers, path, query_string, body,
                                                std::move(stop), files);
    if (!routed) {
        reply->respond(nullptr);
    } else if (!core) {
        reply->fail("Loading model", "unavailable");
    } else if (handler != nullptr) {
        reply->respond([&core, handler](const server_http_req & req) { return (core->routes.*handler)(req); });
    } else {
        reply->respond(stream_route->second);
    }
    return reply;
}

void Engine::close() {
    std::shared_ptr<EngineCore> core;
    bool loaded;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        core.swap(core_);
        loaded = loaded_;
        loaded_ = false;
    }
    if (!core) return;
    core->closing.store(true);  // the requests in flight: should_stop, as if their clients had left
    if (loaded) {
        // start_loop() sets its running flag when it starts: a terminate() that comes
        // first is lost, so it is repeated until the loop has ended
        while (!loop_ended_.load()) {
            core->ctx.terminate();
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
        if (loop_.joinable()) loop_.join();
    }
    // the model and context go now, or with the last reply that still holds them
}

std::string Engine::slot_file(bool save, int slot, const std::string & path) {
    const std::shared_ptr<EngineCore> core = current();
    if (!core) throw std::runtime_error("engine is not loaded");
    server_response_reader rd = core->ctx.get_response_reader();
    server_task task(save ? SERVER_TASK_TYPE_SLOT_SAVE : SERVER_TASK_TYPE_SLOT_RESTORE);
    task.id = rd.get_new_id();
    task.slot_action.id_slot = slot;
    task.slot_action.filename = std::filesystem::path(path).filename().string();
    task.slot_action.filepath = path;
    rd.post_task(std::move(task));
    server_task_result_ptr result = rd.next([] { return false; });
    if (!result) throw std::runtime_error("the engine stopped before the slot action ended");
    json out = result->to_json();
    return safe_json_to_str(result->is_error() ? json{{"error", out}} : out);
}

std::size_t Engine::slot_state_size(int slot) const {
    const std::shared_ptr<EngineCore> core = current();
    llama_context * lctx = core ? core->ctx.get_llama_context() : nullptr;
    return lctx ? llama_state_seq_get_size(lctx, slot) : 0;
}

std::vector<BufferRow> Engine::breakdown() const {
    const std::shared_ptr<EngineCore> core = current();
    const llama_context * lctx = core ? core->ctx.get_llama_context() : nullptr;
    return lctx ? breakdown_of(lctx) : std::vector<BufferRow>{};
}

int Engine::n_parallel() const { return n_parallel_; }
int Engine::n_ctx() const { return n_ctx_; }
int Engine::timeout_write() const { return timeout_write_; }

}  // namespace pyllmrouter
