// A worker's native data path: client connections the router hands over, answered here.
//
//   router ──sendmsg(request, client fd) over a SOCK_SEQPACKET pair──▶ Conduit's receiver
//     a thread per request: Engine::handle (llama-server's handler) ─▶ the HTTP response
//     written to the client's socket from here: status, headers, the body or the SSE stream
//     chunk by chunk as the engine yields it ─▶ done(id, status, bytes, keep) ──▶ router
//
// Once the router has admitted a request and leased its model, no Python touches the
// reply's bytes: the router reads the request (it needs the model's name and the key),
// the worker writes the answer.  A client that leaves is noticed here (its socket hangs
// up, or a write fails): the request's should_stop turns true and llama.cpp ends it.
// The router gets the connection back when done() says so (keep-alive) and reads the
// client's next request itself.
//
// A request that takes a slot (a completion, an embedding...) goes into llama.cpp's hands
// only while the model has fewer such requests there than twice its slots: a slot's worth
// deferred in llama.cpp's own queue, so that every slot that frees is taken at once, even
// all of them in one step (one let in only then would miss the next decode step); the
// others wait here, first come first served, each on a thread that sleeps until its turn.
// llama-server defers them all in its own queue, with their threads waiting for results:
// every result the engine sends (a token of any stream) wakes every waiting thread
// (server_response::send's notify_all), so each request past the slots costs CPU per
// token there, however many come; here, never more than a slot's worth.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace pyllmrouter {

class Engine;
struct StopFlag;

class Conduit {
  public:
    // The most bytes one handed-over request may have (header and body): one datagram.
    static constexpr std::size_t max_message = 256 * 1024;

    // fd: the worker's end of the router's SOCK_SEQPACKET pair (this object owns it).
    explicit Conduit(int fd);
    ~Conduit();

    // A model's engine answers the requests handed over for `name`; `awaited`: slots
    // restored at load whose first use is still to come (a request whose timings say
    // it took cached tokens is a hit).
    void attach(const std::string & name, std::shared_ptr<Engine> engine, int awaited);
    // No more requests for `name`: those in flight are stopped and waited for.  The hits
    // counted for it.
    int detach(const std::string & name);
    // Requests in flight, all models.
    int in_flight() const;
    void close();

  private:
    struct Turn {  // a request waiting for a slot: granted by the one that leaves before it
        bool granted = false;
    };
    struct Model {
        std::shared_ptr<Engine> engine;
        std::set<std::shared_ptr<StopFlag>> requests;
        int awaited = 0;
        int hits = 0;
        bool closing = false;
        // requests that take a slot which llama.cpp may have at once: twice its slots (as many
        // waiting in its own queue as may free in one step)
        int room = 2;
        int in_engine = 0;  // requests that take a slot, in llama.cpp's hands
        std::deque<Turn *> waiting;  // those waiting for a slot, in order
    };

    // A slot for a request of `name` (mutex_ held by `lock`): at once where the model has
    // one free and nobody waits, else in turn.  False: the request stopped (its client
    // left) or the model is closing while it waited.
    bool enter(Model & m, StopFlag & stop, std::unique_lock<std::mutex> & lock);
    // The slot back (mutex_ held): the next waiting request has it.
    void leave(Model & m);

    void receive();
    void run();  // a pool thread: serves what the receiver queues, kept for the next request
    void serve(std::string message, int client);
    void report(long long id, int status, long long bytes, bool keep, const std::string & error);

    int fd_;
    std::thread receiver_;
    std::atomic<bool> closed_{false};
    mutable std::mutex mutex_;  // models_, in_flight_
    std::condition_variable done_;
    std::condition_variable turns_;  // a turn granted, or a model closing
    std::map<std::string, Model> models_;
    int in_flight_ = 0;
    std::mutex send_mutex_;
    // requests waiting for a pool thread, and the pool: one thread per request in flight, kept
    // between requests (starting a thread costs more than the rest of a short request's path)
    std::mutex pool_mutex_;
    std::condition_variable pool_cv_;
    std::vector<std::pair<std::string, int>> jobs_;
    int idle_ = 0;
    int threads_ = 0;
};

}  // namespace pyllmrouter
