// A worker's native data path: see conduit.h.
#include "conduit.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>

#include "cpp-httplib/httplib.h"  // status_message: the reason phrases llama-server's HTTP layer writes
#include "engine.h"
#include "server-common.h"

namespace pyllmrouter {
namespace {

// Writes to the client's socket, which is non-blocking (the router's event loop shares
// its file description).  A full buffer is waited out with poll, for at most `timeout`
// (llama-server's --timeout for writes) without a byte taken: a client that stops reading
// is then gone, as one whose socket errs or hangs up, or whose request stopped.  Counts
// what it wrote.
struct Writer {
    int fd;
    StopFlag & stop;
    std::chrono::milliseconds timeout;
    long long written = 0;
    bool ok = true;

    // What the socket takes of `data` now, without waiting (erased from it).
    void some(std::string & data) {
        size_t at = 0;
        while (ok && at < data.size()) {
            const ssize_t n = ::send(fd, data.data() + at, data.size() - at, MSG_NOSIGNAL | MSG_DONTWAIT);
            if (n > 0) {
                at += static_cast<size_t>(n);
                written += n;
            } else if (n < 0 && errno == EINTR) {
                continue;
            } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
                break;
            } else {
                gone();  // the client is gone (EPIPE, ECONNRESET...)
            }
        }
        if (at == data.size()) data.clear(); else data.erase(0, at);
    }

    // Until the socket takes more: false where the request stopped, the client hung up, or
    // it took nothing for `timeout`.
    bool writable() {
        const auto deadline = std::chrono::steady_clock::now() + timeout;
        while (ok) {
            const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                deadline - std::chrono::steady_clock::now()).count();
            if (left <= 0) {
                gone();  // a reader that stalled: as llama-server's write timeout closes it
                break;
            }
            pollfd pfd{fd, POLLOUT, 0};  // in slices: a stop (an unload, a close) is seen within a second
            const int r = ::poll(&pfd, 1, static_cast<int>(std::min<long long>(left, 1000)));
            if (stop.value.load() || (r > 0 && (pfd.revents & (POLLERR | POLLHUP)))) gone();
            else if (r > 0) return true;
        }
        return false;
    }

    bool write(std::string data) {  // all of it, waiting as it must
        while (ok) {
            some(data);
            if (data.empty() || !writable()) break;
        }
        return ok;
    }

    void gone() {
        ok = false;
        stop.set();  // llama.cpp ends the request at its next should_stop
    }

    static void frame(std::string & into, const std::string & data) {  // one HTTP/1.1 chunk
        if (data.empty()) return;
        char size[24];
        std::snprintf(size, sizeof(size), "%zx\r\n", data.size());
        into.append(size).append(data).append("\r\n");
    }
};

// llama.cpp's own default of --timeout (for a write where no model's engine says its own).
int default_write_timeout() {
    static const int seconds = common_params{}.timeout_write;
    return seconds;
}

// The header lines every answer begins with: llama-server's Server (its HTTP layer's
// default header) and the Date a server with a clock sends (RFC 9110 6.6.1), as the
// router's own answers carry them.
std::string stamp() {
    static const char * const days[] = {"Sun", "Mon", "Tue", "Wed", "Thu", "Fri", "Sat"};
    static const char * const months[] = {"Jan", "Feb", "Mar", "Apr", "May", "Jun",
                                          "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"};
    const std::time_t now = std::time(nullptr);
    std::tm t{};
    gmtime_r(&now, &t);
    char line[96];
    std::snprintf(line, sizeof(line), "Server: llama.cpp\r\nDate: %s, %02d %s %04d %02d:%02d:%02d GMT\r\n",
                  days[t.tm_wday], t.tm_mday, months[t.tm_mon], t.tm_year + 1900, t.tm_hour, t.tm_min, t.tm_sec);
    return line;
}

// A 500 with the error, as llama-server's ex_wrapper answers an exception; the connection closes.
void write_error(Writer & out, const std::string & error) {
    const std::string data = safe_json_to_str({{"error", format_error_response(error, ERROR_TYPE_SERVER)}});
    out.write("HTTP/1.1 500 Internal Server Error\r\n" + stamp() + "Content-Type: application/json; charset=utf-8\r\n"
              "Connection: close\r\nContent-Length: " + std::to_string(data.size()) + "\r\n\r\n" + data);
}

// The "cache_n" of llama-server's timings in a reply: a request that took tokens from a
// slot's cache (0 when none is said).
int cache_n(const std::string & data) {
    static const std::string key = "\"cache_n\":";
    int best = 0;
    for (size_t at = data.find(key); at != std::string::npos; at = data.find(key, at + key.size())) {
        best = std::max(best, std::atoi(data.c_str() + at + key.size()));
    }
    return best;
}

// How deep a JSON text nests its arrays and objects (strings skipped).
int nesting(const std::string & text) {
    int depth = 0, deepest = 0;
    bool in_string = false;
    for (size_t i = 0; i < text.size(); ++i) {
        const char c = text[i];
        if (in_string) {
            if (c == '\\') ++i;
            else if (c == '"') in_string = false;
        } else if (c == '"') {
            in_string = true;
        } else if (c == '[' || c == '{') {
            deepest = std::max(deepest, ++depth);
        } else if (c == ']' || c == '}') {
            --depth;
        }
    }
    return deepest;
}

// llama-server's endpoints whose requests take a slot of the engine (a generation, an
// embedding, a rerank, a transcription) for as long as they run; the others (tokenize,
// templates, props, slot actions...) are answered without waiting for one.  The same list
// as pyllmrouter/endpoints.py's (tests/http/test_endpoints.py compares them).
bool takes_slot(const std::string & path) {
    static const std::set<std::string> paths = {
        "/completion", "/completions", "/v1/completions", "/chat/completions", "/v1/chat/completions",
        "/infill", "/responses", "/v1/responses", "/v1/messages", "/embedding", "/embeddings",
        "/v1/embeddings", "/rerank", "/reranking", "/v1/rerank", "/v1/reranking",
        "/v1/audio/transcriptions", "/audio/transcriptions"};
    return paths.count(path) > 0;
}

std::map<std::string, std::string> string_map(const json & j) {
    std::map<std::string, std::string> out;
    if (j.is_object()) {
        for (auto it = j.begin(); it != j.end(); ++it) {
            out[it.key()] = it.value().is_string() ? it.value().get<std::string>() : it.value().dump();
        }
    }
    return out;
}

}  // namespace

Conduit::Conduit(int fd) : fd_(fd) {
    receiver_ = std::thread([this] { receive(); });
}

Conduit::~Conduit() { close(); }

void Conduit::attach(const std::string & name, std::shared_ptr<Engine> engine, int awaited) {
    std::lock_guard<std::mutex> lock(mutex_);
    Model & m = models_[name];
    m.room = 2 * std::max(1, engine->n_parallel());
    m.engine = std::move(engine);
    m.awaited = awaited;
    m.hits = 0;
    m.closing = false;
    m.ends.clear();  // a new load: the router's epochs of this name start again
    m.ended = 0;
}

std::chrono::steady_clock::time_point Conduit::Model::end_of(unsigned long long epoch) const {
    auto at = epoch < ended ? std::chrono::steady_clock::time_point{} : std::chrono::steady_clock::time_point::max();
    for (auto it = ends.upper_bound(epoch); it != ends.end(); ++it) at = std::min(at, it->second);
    return at;
}

int Conduit::detach(const std::string & name) {
    std::unique_lock<std::mutex> lock(mutex_);
    auto it = models_.find(name);
    if (it == models_.end()) return 0;
    it->second.closing = true;
    for (const auto & stop : it->second.requests) stop->set();
    turns_.notify_all();  // those waiting for a slot end too
    done_.wait(lock, [&] { return it->second.requests.empty(); });
    const int hits = it->second.hits;
    models_.erase(it);
    return hits;
}

int Conduit::in_flight() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return in_flight_;
}

void Conduit::close() {
    if (closed_.exchange(true)) return;
    ::shutdown(fd_, SHUT_RDWR);  // the receiver's recvmsg returns
    if (receiver_.joinable()) receiver_.join();
    std::unique_lock<std::mutex> lock(mutex_);
    for (auto & [name, m] : models_) {
        m.closing = true;
        for (const auto & stop : m.requests) stop->set();
    }
    turns_.notify_all();
    done_.wait(lock, [this] { return in_flight_ == 0; });
    lock.unlock();
    std::unique_lock<std::mutex> pool(pool_mutex_);
    pool_cv_.notify_all();
    pool_cv_.wait(pool, [this] { return threads_ == 0; });  // no thread of the pool outlives us
    ::close(fd_);
}

void Conduit::receive() {
    std::string buffer(max_message + 1, '\0');
    while (!closed_.load()) {
        iovec iov{buffer.data(), buffer.size()};
        alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)];
        msghdr msg{};
        msg.msg_iov = &iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control;
        msg.msg_controllen = sizeof(control);
        const ssize_t n = ::recvmsg(fd_, &msg, MSG_CMSG_CLOEXEC);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;  // the router is gone, or close()
        int client = -1;
        for (cmsghdr * c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
            if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
            const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
            for (size_t i = 0; i < count; ++i) {
                int fd;
                std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
                if (client < 0) client = fd; else ::close(fd);
            }
        }
        if (msg.msg_flags & MSG_TRUNC) {  // the router never sends one this big
            if (client >= 0) ::close(client);
            continue;
        }
        if (client < 0) {  // no connection: the router's word on what it handed over before
            command(std::string(buffer.data(), static_cast<size_t>(n)));
            continue;
        }
        {
            std::lock_guard<std::mutex> lock(mutex_);
            ++in_flight_;
        }
        bool spawn = false;
        {
            std::lock_guard<std::mutex> lock(pool_mutex_);
            jobs_.push_back(Job{std::string(buffer.data(), static_cast<size_t>(n)), client});
            if (idle_ < static_cast<int>(jobs_.size())) {
                ++threads_;
                spawn = true;
            }
        }
        if (spawn) {
            std::thread(&Conduit::run, this).detach();
        } else {
            pool_cv_.notify_one();
        }
    }
    pool_cv_.notify_all();  // idle pool threads end
}

void Conduit::run() {
    std::unique_lock<std::mutex> lock(pool_mutex_);
    while (true) {
        ++idle_;
        const bool got = pool_cv_.wait_for(lock, std::chrono::seconds(60),
                                           [this] { return !jobs_.empty() || closed_.load(); });
        --idle_;
        if (!got || jobs_.empty()) break;  // idle a minute, or closing: the thread ends
        Job job = std::move(jobs_.front());
        jobs_.pop_front();
        lock.unlock();
        serve(std::move(job));
        lock.lock();
    }
    --threads_;
    pool_cv_.notify_all();  // close() waits for the last one
}

bool Conduit::enter(Model & m, StopFlag & stop, std::unique_lock<std::mutex> & lock) {
    if (m.in_engine < m.room && m.waiting.empty()) {
        ++m.in_engine;
        return true;
    }
    Turn turn;
    m.waiting.push_back(&turn);
    while (!turn.granted) {
        // a client that leaves is seen within a second, as llama.cpp's handler sees it
        if (m.closing || stop.stopped()) {
            m.waiting.erase(std::find(m.waiting.begin(), m.waiting.end(), &turn));
            return false;
        }
        turns_.wait_for(lock, std::chrono::seconds(1));
    }
    return true;
}

void Conduit::leave(Model & m) {
    --m.in_engine;
    while (m.in_engine < m.room && !m.waiting.empty()) {
        m.waiting.front()->granted = true;
        m.waiting.pop_front();
        ++m.in_engine;
    }
    turns_.notify_all();
}

void Conduit::serve(Job job) {
    const int client = job.client;
    long long id = -1;
    Outcome last;
    json answers = json::array();  // [status, bytes, seconds] of each request answered, not yet reported
    int answered = 0;
    Follow follow;
    std::string name;  // the model whose follows `follow` is registered with ("": none)
    try {
        const size_t nul = job.message.find('\0');
        const json h = json::parse(job.message.substr(0, nul));
        std::string body = nul == std::string::npos ? std::string() : job.message.substr(nul + 1);
        job.message.clear();
        id = h.at("id").get<long long>();
        Request req;
        req.name = h.at("model").get<std::string>();
        req.method = h.at("method").get<std::string>();
        req.path = h.at("path").get<std::string>();
        req.query = string_map(h.value("query", json::object()));
        req.headers = string_map(h.value("headers", json::object()));
        req.query_string = h.value("query_string", std::string());
        req.keep_alive = h.value("keep_alive", true);
        for (const auto & kv : h.value("extra", json::array())) {  // the router's headers (CORS)
            req.extra += kv.at(0).get<std::string>() + ": " + kv.at(1).get<std::string>() + "\r\n";
        }
        const json f = h.value("follow", json());
        if (f.is_object() && req.keep_alive) {
            follow.line = f.at("line").get<std::string>();
            follow.headers = req.headers;  // the engine's copy, and those it leaves out
            for (const auto & [k, v] : string_map(f.at("headers"))) follow.headers[k] = v;
            follow.named = f.at("named").get<std::string>();
            follow.max_body = f.at("max_body").get<size_t>();
            follow.idle_ms = f.at("idle_ms").get<int>();
            follow.report_ms = f.at("ms").get<int>();
            follow.epoch = f.value("epoch", 0ULL);
            if (f.contains("end_ms")) {  // leased during a drained model's turn: its end
                follow.until = std::chrono::steady_clock::now() + std::chrono::milliseconds(f.at("end_ms").get<int>());
            }
            std::lock_guard<std::mutex> lock(mutex_);
            auto it = models_.find(req.name);
            if (it != models_.end() && !it->second.closing) {
                Model & m = it->second;
                m.follows.insert(&follow);
                name = req.name;
                follow.until = std::min(follow.until, m.end_of(follow.epoch));  // an end that came first
            }
        }
        auto reported = std::chrono::steady_clock::now();
        while (true) {
            const auto began = std::chrono::steady_clock::now();
            last = answer(req, body, client);
            const auto now = std::chrono::steady_clock::now();
            answers.push_back(json::array(
                {last.status, last.written, std::chrono::duration<double>(now - began).count()}));
            ++answered;
            if (name.empty() || !last.keep) break;
            // the router's counts, meanwhile: every report period, and in datagrams it reads whole
            if (now - reported >= std::chrono::milliseconds(follow.report_ms) || answers.size() >= max_listed) {
                send(safe_json_to_str({{"id", id}, {"progress", true}, {"answers", answers}}));
                answers = json::array();
                reported = now;
            }
            if (!read_next(client, name, follow, body)) break;
        }
    } catch (const std::exception & e) {  // the router's message unreadable
        last.error = e.what();
        last.keep = false;
        if (id >= 0 && answered == 0) {  // nothing written yet: say it
            StopFlag stop;
            Writer out{client, stop, std::chrono::seconds(default_write_timeout())};
            write_error(out, last.error);
            last.status = 500;
            last.written = out.written;
        }
    }
    if (!name.empty()) {
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = models_.find(name);
        if (it != models_.end()) it->second.follows.erase(&follow);
    }
    ::close(client);  // the router's descriptor stays: the connection is its own again
    if (id >= 0) report(id, last.status, last.written, last.keep, last.error, name.empty() ? nullptr : &answers);
    {
        std::lock_guard<std::mutex> lock(mutex_);
        --in_flight_;
    }
    done_.notify_all();
}

void Conduit::command(const std::string & message) {
    const json c = json::parse_no_throw(message);
    if (!c.is_object() || !c.contains("end") || !c.at("end").is_string()) return;
    const auto now = std::chrono::steady_clock::now();
    const auto at = now + std::chrono::milliseconds(std::max(0, c.value("ms", 0)));
    const unsigned long long epoch = c.value("epoch", 0ULL);
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = models_.find(c.at("end").get<std::string>());
    if (it == models_.end()) return;
    Model & m = it->second;
    for (Follow * f : m.follows) {
        if (f->epoch < epoch) f->until = std::min(f->until, at);
    }
    auto [end, fresh] = m.ends.emplace(epoch, at);  // for the follows whose hand-over comes after it
    if (!fresh) end->second = std::min(end->second, at);
    for (auto e = m.ends.begin(); e != m.ends.end();) {  // those due: one number
        if (e->second <= now) {
            m.ended = std::max(m.ended, e->first);
            e = m.ends.erase(e);
        } else {
            ++e;
        }
    }
}

Conduit::Outcome Conduit::answer(const Request & req, const std::string & body, int client) {
    Outcome o;
    auto stop = std::make_shared<StopFlag>();
    stop->peer = client;
    Writer out{client, *stop, std::chrono::seconds(default_write_timeout())};
    const std::string connection = req.keep_alive ? "" : "Connection: close\r\n";
    bool registered = false;
    Model * model = nullptr;  // while registered: detach() waits for its requests before it erases
    bool holds_slot = false;
    auto release_slot = [&] {  // as soon as the engine is done with the request, once
        if (!holds_slot) return;
        std::lock_guard<std::mutex> lock(mutex_);
        leave(*model);
        holds_slot = false;
    };
    try {
        std::shared_ptr<Engine> engine;
        int awaited = 0;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            auto it = models_.find(req.name);
            if (it != models_.end() && !it->second.closing) {
                engine = it->second.engine;
                out.timeout = std::chrono::seconds(std::max(1, engine->timeout_write()));
                awaited = it->second.awaited;
                it->second.requests.insert(stop);
                registered = true;
                model = &it->second;
            }
        }
        bool left = false;  // the client left while its request waited for a slot
        if (engine && takes_slot(req.path)) {
            std::unique_lock<std::mutex> lock(mutex_);
            holds_slot = enter(*model, *stop, lock);
            if (!holds_slot && model->closing) {
                engine.reset();  // unloading: the 503 below
            } else if (!holds_slot) {
                left = true;
            }
        }
        // unloaded meanwhile, or stopped by an unload or a close: what llama-server says of a
        // model not ready, never a reply the request did not finish
        auto unavailable = [&] {
            o.status = 503;
            const std::string data = safe_json_to_str(
                {{"error", format_error_response("Loading model", ERROR_TYPE_UNAVAILABLE)}});
            out.write("HTTP/1.1 503 Service Unavailable\r\n" + stamp() +
                      "Content-Type: application/json; charset=utf-8\r\nRetry-After: 1\r\n" + req.extra +
                      connection + "Content-Length: " + std::to_string(data.size()) + "\r\n\r\n" + data);
            o.keep = req.keep_alive && out.ok;
        };
        std::shared_ptr<EngineReply> reply;
        if (!left && engine) {
            reply = engine->handle(req.method, req.path, req.query, req.headers, body, req.query_string, stop);
        }
        if (left || stop->peer_gone()) {
            // the client is gone (or has ended its side: llama-server's connection check reads
            // that as gone, and so does the router's relay): nothing is written to it
            o.status = 499;
        } else if (!engine || reply->cut()) {
            unavailable();
        } else {
            o.status = reply->status();
            std::string head = "HTTP/1.1 " + std::to_string(o.status) + " " + httplib::status_message(o.status) +
                               "\r\n" + stamp() + "Content-Type: " + reply->content_type() + "\r\n";
            for (const auto & [k, v] : reply->headers()) head += k + ": " + v + "\r\n";
            head += req.extra + connection;
            int seen = 0;
            bool cut = false;  // a stream stopped before its end
            if (!reply->is_stream()) {
                release_slot();  // the whole reply is here: its slot is free
                const std::string & data = reply->data();
                head += "Content-Length: " + std::to_string(data.size()) + "\r\n\r\n";
                out.write(head + data);
                if (awaited > 0) seen = cache_n(data);
            } else {
                // The stream: each chunk as llama.cpp yields it (the first one included: the
                // handler holds it in data(), and next() gives it, once), written as far as the
                // socket takes it without waiting.  What the client has not taken yet waits
                // here, up to max_pending; past that, the engine's next results wait in
                // llama.cpp's own queue (as they do for llama-server's) and the request leaves
                // the slot gate: a client that reads slowly, or not at all, never holds the
                // engine.  The slot gate is left at the stream's end at the latest.
                // A stream stopped under way (its client gone, an unload, a close) ends without
                // its last chunk: the connection closes on a response a client sees incomplete.
                std::string pending = head + "Transfer-Encoding: chunked\r\n\r\n";
                std::string chunk;
                bool more = true;
                while (out.ok) {
                    if (more && pending.size() < max_pending) {
                        more = reply->next(chunk);
                        if (awaited > 0) seen = std::max(seen, cache_n(chunk));
                        Writer::frame(pending, chunk);
                        if (!more) {
                            release_slot();  // the stream's end: its slot is free
                            if (reply->cut()) cut = true;
                            else pending += "0\r\n\r\n";
                        }
                    }
                    out.some(pending);
                    if (pending.empty() && !more) break;
                    if (!more || pending.size() >= max_pending) {  // the client's turn to take some
                        release_slot();
                        if (!out.writable()) break;
                    }
                }
            }
            o.keep = req.keep_alive && out.ok && !cut && !stop->stopped();  // before the reply goes: it sets the flag
            reply.reset();  // on_complete, as llama-server's connection ends
            if (seen > 0) {
                std::lock_guard<std::mutex> lock(mutex_);
                auto it = models_.find(req.name);
                if (it != models_.end() && it->second.awaited > 0) {
                    --it->second.awaited;
                    ++it->second.hits;
                }
            }
        }
    } catch (const std::exception & e) {
        o.error = e.what();
        if (out.written == 0) {  // nothing written yet: say it
            o.status = 500;
            write_error(out, o.error);
        }
        o.keep = false;
    }
    release_slot();  // where the reply did not end (a stream cut short, an error): after it
    if (registered) {
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = models_.find(req.name);
        if (it != models_.end()) it->second.requests.erase(stop);
    }
    o.written = out.written;
    return o;
}

long long Conduit::follow_wait(const std::string & name, const Follow & follow) const {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = models_.find(name);
    if (it == models_.end() || it->second.closing || closed_.load()) return 0;
    const auto now = std::chrono::steady_clock::now();
    if (now >= follow.until) return 0;
    const long long left = std::chrono::duration_cast<std::chrono::milliseconds>(follow.until - now).count();
    return std::min<long long>(left, follow.idle_ms);
}

bool Conduit::read_next(int client, const std::string & name, const Follow & follow, std::string & body) {
    const int wait = static_cast<int>(follow_wait(name, follow));
    if (wait <= 0) return false;
    pollfd pfd{client, POLLIN, 0};
    if (::poll(&pfd, 1, wait) <= 0) return false;
    if (!(pfd.revents & POLLIN) || (pfd.revents & (POLLERR | POLLHUP))) return false;
    // a head and its body may come in separate segments: the rest is waited for as long,
    // woken by the next byte (SO_RCVLOWAT: poll says readable once that many are there)
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(wait);
    std::string buf;
    long long total = 0;
    bool lowered = false;
    while (true) {
        buf.assign(max_head + follow.max_body + 1, '\0');
        const ssize_t n = ::recv(client, buf.data(), buf.size(), MSG_PEEK | MSG_DONTWAIT);
        if (n <= 0) break;  // the client closed (the router sees it), or nothing after all
        buf.resize(static_cast<size_t>(n));
        total = next_request(buf, follow);
        const long long left_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - std::chrono::steady_clock::now()).count();
        if (total != 0 || left_ms <= 0 || static_cast<size_t>(n) > max_head + follow.max_body) break;
        const int more = static_cast<int>(n) + 1;
        if (::setsockopt(client, SOL_SOCKET, SO_RCVLOWAT, &more, sizeof(more)) != 0) break;
        lowered = true;
        pollfd again{client, POLLIN, 0};
        if (::poll(&again, 1, static_cast<int>(left_ms)) <= 0 || (again.revents & (POLLERR | POLLHUP))) break;
    }
    if (lowered) {  // the socket is the router's again: as it was
        const int one = 1;
        ::setsockopt(client, SOL_SOCKET, SO_RCVLOWAT, &one, sizeof(one));
    }
    if (total <= 0 || static_cast<size_t>(total) != buf.size()) return false;  // not one whole request like the last
    if (follow_wait(name, follow) <= 0) return false;  // the router ended it meanwhile: the request is its
    // taken off the socket now: the same bytes as those peeked, which they overwrite
    if (::recv(client, buf.data(), buf.size(), MSG_DONTWAIT) != total) {
        return false;  // cannot happen (its bytes were there); the connection is not the router's to read now
    }
    body = buf.substr(buf.find("\r\n\r\n") + 4);
    return true;
}

long long Conduit::next_request(const std::string & buf, const Follow & follow) {
    const size_t end = buf.find("\r\n\r\n");
    if (end == std::string::npos) return buf.size() > max_head ? -1 : 0;
    if (end > max_head) return -1;
    size_t at = buf.find("\r\n");
    if (buf.compare(0, at, follow.line) != 0 || at != follow.line.size()) return -1;
    std::map<std::string, std::string> headers;
    long long length = -1;
    while (at < end) {
        const size_t from = at + 2;
        at = buf.find("\r\n", from);
        const std::string line = buf.substr(from, at - from);
        const size_t colon = line.find(':');
        if (colon == 0 || colon == std::string::npos) return -1;
        std::string name = line.substr(0, colon);
        for (char & c : name) {
            if (c <= ' ' || c == 0x7f) return -1;  // no whitespace or control in a name (nor a folded line)
            c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
        }
        size_t a = colon + 1, b = line.size();
        while (a < b && (line[a] == ' ' || line[a] == '\t')) ++a;
        while (b > a && (line[b - 1] == ' ' || line[b - 1] == '\t')) --b;
        const std::string value = line.substr(a, b - a);
        if (name == "content-length") {
            if (length >= 0 || value.empty() || value.size() > 9 ||
                value.find_first_not_of("0123456789") != std::string::npos) return -1;
            length = std::stoll(value);
        } else if (!headers.emplace(name, value).second) {
            return -1;  // a name given twice
        }
    }
    if (length < 0 || static_cast<size_t>(length) > follow.max_body || headers != follow.headers) return -1;
    const size_t total = end + 4 + static_cast<size_t>(length);
    if (buf.size() < total) return 0;  // its body still to come
    // the model its body names: the same as the last one's ("": none, the query's then); a
    // body the router might read otherwise (a byte-order mark, deep nesting) is the router's
    const std::string text = buf.substr(end + 4, static_cast<size_t>(length));
    if (text.compare(0, 3, "\xEF\xBB\xBF") == 0 || nesting(text) > max_nesting) return -1;
    const json data = json::parse_no_throw(text);
    if (data.is_discarded()) return -1;
    std::string named;
    if (data.is_object() && data.contains("model") && data.at("model").is_string()) {
        named = data.at("model").get<std::string>();
    }
    return named == follow.named ? static_cast<long long>(total) : -1;
}

void Conduit::report(long long id, int status, long long bytes, bool keep, const std::string & error,
                     const json * answers) {
    json done = {{"id", id}, {"status", status}, {"bytes", bytes}, {"keep", keep}, {"error", error}};
    if (answers != nullptr) done["answers"] = *answers;  // it read the connection's next requests itself
    send(safe_json_to_str(done));
}

void Conduit::send(const std::string & message) {
    std::lock_guard<std::mutex> lock(send_mutex_);
    while (::send(fd_, message.data(), message.size(), MSG_NOSIGNAL) < 0 && errno == EINTR) {
    }
}

}  // namespace pyllmrouter
