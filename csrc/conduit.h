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
// client's next request itself, or, where it said so (`follow`), once the worker has read
// the client's next requests itself: while they are like the one the router let through
// (the same request line, the same headers but Content-Length, a whole body naming the
// same model, nothing after it) and each comes within a short pause of the last answer,
// each is answered here too, under the same lease.  The worker lists them for the router's
// counts (status, bytes, seconds) every report period (progress) and in done().  Anything
// else (another model, other headers, a pause) is left unread for the router, which reads
// it as any request.  The router ends a model's follows when it must see the requests
// again (an unload, a drain for another model's waiter, a retirement, a new instance to
// share them with): end(model, epoch, ms) on the same channel, a datagram without a
// descriptor, which ends every follow of a lease taken before it (each hand-over carries
// its lease's epoch), whatever order the datagrams arrive in.  The worker reads a
// connection only where the router's parser holds no byte of it past the request handed
// over (the router sends no follow otherwise).
//
// A client that stops reading holds nothing for long: what it has not taken of a stream
// waits here up to max_pending, the request leaves the slot gate then (or at the stream's
// end, whichever comes first), and a write that makes no progress for llama-server's
// --timeout ends the request as a departed client's.
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
#include <chrono>
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

class common_json;  // llama.cpp's common/json.h

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
    // A request head's most bytes the worker reads itself (a follow's), and the deepest
    // nesting of its JSON body (deeper: the router's, whose parser has a recursion limit).
    static constexpr std::size_t max_head = 8 * 1024;
    static constexpr int max_nesting = 200;
    // The most answers one progress lists (about 40 bytes each: the router reads 64 KiB at most).
    static constexpr std::size_t max_listed = 256;
    // The most bytes of a stream the worker holds for a client that has not taken them yet
    // (beyond what the kernel's socket buffer holds): past it, the engine's next results wait
    // in llama.cpp's own queue, as llama-server's do, and the request leaves the slot gate.
    static constexpr std::size_t max_pending = 1 << 20;
    // What the router let through on a connection, for the worker to read the next
    // requests itself while they are alike: the request line ("POST /v1/completions
    // HTTP/1.1"), the headers by lower-case name but Content-Length (the engine's copy and
    // those the router kept from it), the model the body named ("": none), the longest
    // body, how long a pause may be, how often the answers are reported, the lease's epoch
    // (the model's count of the router's ends when it was taken), and until when (the
    // router's end: mutex_ held, where the follow is registered with its model).
    struct Follow {
        std::string line;
        std::map<std::string, std::string> headers;
        std::string named;
        std::size_t max_body = 0;
        int idle_ms = 0;
        int report_ms = 0;
        unsigned long long epoch = 0;
        std::chrono::steady_clock::time_point until = std::chrono::steady_clock::time_point::max();
    };
    // The bytes of the request at the start of `buf` where it is whole and like the one
    // `follow` describes; 0 where it may be, its rest still to come; -1 where it is not.
    static long long next_request(const std::string & buf, const Follow & follow);

    struct Request {  // a request as the router handed it over (the next ones alike)
        std::string name, method, path, query_string, extra;
        std::map<std::string, std::string> query, headers;
        bool keep_alive = true;
    };
    struct Outcome {  // what answering it did
        int status = 0;
        long long written = 0;
        bool keep = false;
        std::string error;
    };
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
        std::set<Follow *> follows;  // connections followed, their requests read here
        // The router's ends: end(model, epoch E, ms) ends, by then, every follow of a lease
        // taken before it (epoch < E), whether its hand-over came before the end or after
        // (a lease taken just before an end whose datagram lands after it); the sooner of
        // two ends stands.  Those due by now are folded into `ended` (the highest such E).
        std::map<unsigned long long, std::chrono::steady_clock::time_point> ends;
        unsigned long long ended = 0;
        // When the router's ends end a follow of a lease of `epoch` (max(): none does).
        std::chrono::steady_clock::time_point end_of(unsigned long long epoch) const;
    };
    struct Job {  // a request handed over, waiting for a pool thread
        std::string message;
        int client;
    };

    // A slot for a request of `name` (mutex_ held by `lock`): at once where the model has
    // one free and nobody waits, else in turn.  False: the request stopped (its client
    // left) or the model is closing while it waited.
    bool enter(Model & m, StopFlag & stop, std::unique_lock<std::mutex> & lock);
    // The slot back (mutex_ held): the next waiting request has it.
    void leave(Model & m);

    void receive();
    void run();  // a pool thread: serves what the receiver queues, kept for the next request
    void serve(Job job);
    // end(model, epoch, ms) from the router: the model's follows of leases before `epoch`
    // end within ms (0: after their request in progress)
    void command(const std::string & message);
    Outcome answer(const Request & req, const std::string & body, int client);
    // How long the follow may wait for the next request now (ms; <= 0: it ends): its pause,
    // within the router's end, while the model takes requests.
    long long follow_wait(const std::string & name, const Follow & follow) const;
    // The client's next request, where it comes within the pause and is alike: read (its
    // body into `body`); else nothing read.
    bool read_next(int client, const std::string & name, const Follow & follow, std::string & body);
    // done: the last request's status and bytes, whether the connection may take the next,
    // and, where the worker followed the connection (`answers` not null), each request's
    // [status, bytes, seconds] in order that no progress listed yet
    void report(long long id, int status, long long bytes, bool keep, const std::string & error,
                const common_json * answers);
    void send(const std::string & message);  // one datagram to the router

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
    std::deque<Job> jobs_;
    int idle_ = 0;
    int threads_ = 0;
};

}  // namespace pyllmrouter
