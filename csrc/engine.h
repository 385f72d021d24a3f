// llama.cpp's own server engine for one model, without an HTTP server.
//
// An Engine is llama-server minus cpp-httplib: its arguments are parsed by
// llama.cpp's parser (common_params_parse, LLAMA_EXAMPLE_SERVER), the model and
// context are loaded by server_context::load_model, the slot loop runs on a
// thread of its own, and every endpoint is the server_routes handler that
// llama-server's server.cpp registers for that method and path. A request is a
// plain (method, path, params, headers, body); the reply is llama-server's
// status, content type, headers and body, or a stream read chunk by chunk.
//
// Several Engines live in one process: each owns its server_context, and they
// share the process's backends (one context per device).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "params.h"
#include "probe.h"

struct server_context;
struct server_routes;
struct server_http_req;
struct server_http_res;

namespace pyllmrouter {

// Set from any thread to stop a request: the handler's should_stop turns true,
// as when llama-server's client closes its connection.  With a peer (the client's
// socket, on the native data path: conduit.h), a client that hung up stops it too.
struct StopFlag {
    std::atomic<bool> value{false};
    int peer = -1;
    void set() { value.store(true); }
    bool stopped() const { return value.load() || peer_gone(); }
    // The client ended its side of the connection (a close, a half-close: the two look
    // the same until something is written), or its socket erred: llama-server's
    // is_connection_closed (a peek that reads the end) says so of both.
    bool peer_gone() const;
};

// What a reply keeps alive (an Engine's server_context and routes, the router's
// services), and whether its owner is closing: a reply holds it, so what a handler or
// a stream uses lives as long as the reply does.
struct ReplyOwner {
    std::atomic<bool> closing{false};
    virtual ~ReplyOwner() = default;
};

// An Engine's server_context, routes and parsed arguments (engine.cpp).
struct EngineCore;

// A file of a multipart request, as llama-server's HTTP layer hands it to a handler.
struct UploadedFile {
    std::string filename;
    std::string content_type;
    std::string data;
};
using Files = std::map<std::string, UploadedFile>;

// A llama-server route handler (server_http_context::handler_t's signature).
using Handler = std::function<std::unique_ptr<server_http_res>(const server_http_req &)>;

// One request's reply. next() returns false once the stream has ended (a
// non-streamed reply is `data` alone); cancel() makes the handler's
// should_stop true, as a closed connection does in llama-server, and so does
// the engine's close().
class EngineReply {
  public:
    EngineReply(std::shared_ptr<ReplyOwner> owner, std::map<std::string, std::string> params,
                std::map<std::string, std::string> headers, std::string path, std::string query, std::string body,
                std::shared_ptr<StopFlag> stop, const Files & files = {});
    ~EngineReply();

    // The handler's reply, as llama-server's ex_wrapper makes it (std::invalid_argument:
    // 400, any other exception: 500); no handler: llama-server's 404 for an unknown path.
    void respond(const Handler & handler);
    // llama-server's error reply (format_error_response) of this message and type name
    // ("invalid_request", "not_found", "unavailable", "server"...).
    void fail(const std::string & message, const std::string & type);

    int status() const;
    const std::string & content_type() const;
    const std::map<std::string, std::string> & headers() const;
    const std::string & data() const;
    bool is_stream() const;
    bool next(std::string & chunk);  // false: nothing after this chunk
    void cancel() { stop_->set(); }
    // Stopped before it was whole: a handler that returned what llama.cpp returns for a
    // request stopped under way (its default reply: 200, no body), or a stream that ended
    // at a stop, not at its last result.  Such a reply has earned no success: a plain one
    // is made llama-server's 503 for a model not ready ("Loading model", Retry-After: 1),
    // a stream is left without its end.
    bool cut() const { return cut_; }

  private:
    std::shared_ptr<ReplyOwner> owner_;  // first: it goes after the request and reply that use it
    std::shared_ptr<StopFlag> stop_;
    std::function<bool()> should_stop_;
    std::unique_ptr<server_http_req> req_;
    std::unique_ptr<server_http_res> res_;
    bool ended_ = false;
    bool cut_ = false;
};

// What loading a model with these llama-server arguments allocates, probed with
// no_alloc from the very llama params the engine builds from them
// (common_model_params_to_llama, common_context_params_to_llama).
// vocab_free: probe a copy of the header without the vocabulary's content
// (write_vocab_free_header), the same bytes without building a tokenizer.
ProbeResult probe_server(const std::vector<std::string> & args, bool vocab_free = true);

// Where the streams of one model's engine leave their chunks: pumps push
// (request id, chunk, last, cut) as llama.cpp yields them, and one reader takes all
// that is there in one go, so a decode step's chunks of every stream leave the
// process together.  Takes are paced: one comes at least interval_s after the
// one before, so a stream whose tokens come faster than that leaves in groups
// (one pipe message and one socket write for several tokens); after a pause the
// first chunk leaves at once.
class Outbox {
  public:
    struct Item {
        std::int64_t req_id;
        std::string chunk;
        bool last;
        bool cut = false;  // the last item of a stream that was stopped (EngineReply::cut)
    };
    explicit Outbox(double interval_s = 0.0);
    void push(Item item);
    // Everything queued, waiting up to timeout_s for the first item; empty on timeout.
    std::vector<Item> take(double timeout_s);

  private:
    std::mutex mutex_;
    std::condition_variable cv_;
    std::vector<Item> items_;
    std::chrono::steady_clock::duration interval_;
    std::chrono::steady_clock::time_point last_take_{};
};

// Reads a streamed reply to its end on a thread of its own, into the outbox;
// the last item (last = true) comes after the reply is complete and released.
void pump(std::shared_ptr<EngineReply> reply, std::int64_t req_id, std::shared_ptr<Outbox> out);

class Engine {
  public:
    // args as llama-server takes them (without the program name); parsed now.
    explicit Engine(const std::vector<std::string> & args);
    ~Engine();

    // Loads the model and starts the slot loop; throws std::runtime_error.  progress, if
    // given, gets llama-server's loading state as the load goes (its SERVER_STATE_LOADING
    // payload as JSON: {stages, current, value}, at most every 200 ms, llama.cpp's throttle).
    void load(const std::function<void(const std::string &)> & progress = {});
    // The reply of the handler llama-server has for (method, path); 404 if none.
    std::shared_ptr<EngineReply> handle(const std::string & method, const std::string & path,
                                        const std::map<std::string, std::string> & query,
                                        const std::map<std::string, std::string> & headers,
                                        const std::string & body, const std::string & query_string,
                                        std::shared_ptr<StopFlag> stop, const Files & files = {});
    // Ends the requests in flight (their should_stop turns true) and the loop, and
    // frees the model and context, or leaves that to the last reply still held
    // (idempotent).
    void close();

    // A slot's state saved to, or restored from, ``path`` (the router's own keep store,
    // not the --slot-save-path a client's /slots action may reach): llama-server's slot
    // save/restore task posted on the engine's own queue.  llama-server's JSON result
    // ({"n_saved", "n_written"...}), or its error ({"error": ...}).
    std::string slot_file(bool save, int slot, const std::string & path);
    // The bytes of slot `slot`'s KV state (llama_state_seq_get_size: what a save writes,
    // beside its tokens), with no request running; 0 when nothing is loaded.
    std::size_t slot_state_size(int slot) const;

    std::vector<BufferRow> breakdown() const;
    int n_parallel() const;
    int n_ctx() const;
    // llama-server's --timeout for writes (seconds): a client that takes no byte for this
    // long is taken as gone
    int timeout_write() const;

  private:
    // the core and whether it is loaded, read and changed under mutex_ (close() may
    // come from another thread than a handle())
    std::shared_ptr<EngineCore> current() const;
    mutable std::mutex mutex_;
    std::shared_ptr<EngineCore> core_;
    bool loaded_ = false;
    int n_parallel_ = 0;
    int timeout_write_ = 0;
    std::atomic<int> n_ctx_{0};  // as asked; the context's own once loaded (load may run on another thread)
    std::thread loop_;
    std::atomic<bool> loop_ended_{true};
};

}  // namespace pyllmrouter
