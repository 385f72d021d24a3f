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

#include "cpp-httplib/httplib.h"  // status_message: the reason phrases llama-server's HTTP layer writes
#include "engine.h"
#include "server-common.h"

namespace pyllmrouter {
namespace {

// Writes to the client's socket, which is non-blocking (the router's event loop shares
// its file description): a full buffer is waited out with poll, a stopped request or a
// socket in error ends the writing.  Counts what it wrote.
struct Writer {
    int fd;
    StopFlag & stop;
    long long written = 0;
    bool ok = true;

    bool write(const std::string & data) {
        const char * p = data.data();
        size_t left = data.size();
        while (ok && left > 0) {
            const ssize_t n = ::send(fd, p, left, MSG_NOSIGNAL | MSG_DONTWAIT);
            if (n > 0) {
                p += n;
                left -= static_cast<size_t>(n);
                written += n;
            } else if (n < 0 && errno == EINTR) {
                continue;
            } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
                pollfd pfd{fd, POLLOUT, 0};
                const int r = ::poll(&pfd, 1, 1000);
                if (stop.value.load() || (r > 0 && (pfd.revents & (POLLERR | POLLHUP)))) ok = false;
            } else {
                ok = false;  // the client is gone (EPIPE, ECONNRESET...)
            }
        }
        if (!ok) stop.set();  // llama.cpp ends the request at its next should_stop
        return ok;
    }

    static void frame(std::string & into, const std::string & data) {  // one HTTP/1.1 chunk
        if (data.empty()) return;
        char size[24];
        std::snprintf(size, sizeof(size), "%zx\r\n", data.size());
        into.append(size).append(data).append("\r\n");
    }

    bool chunk(const std::string & data, bool last = false) {  // the last with the stream's end
        std::string framed;
        framed.reserve(data.size() + 32);
        frame(framed, data);
        if (last) framed += "0\r\n\r\n";
        return framed.empty() ? ok : write(framed);
    }
};

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

// llama-server's endpoints whose requests take a slot of the engine (a generation, an
// embedding, a rerank) for as long as they run; the others (tokenize, templates, props,
// slot actions...) are answered without waiting for one.
bool takes_slot(const std::string & path) {
    static const std::set<std::string> paths = {
        "/completion", "/completions", "/v1/completions", "/chat/completions", "/v1/chat/completions",
        "/infill", "/responses", "/v1/responses", "/v1/messages", "/embedding", "/embeddings",
        "/v1/embeddings", "/rerank", "/reranking", "/v1/rerank", "/v1/reranking"};
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
        if (client < 0) continue;  // nothing to answer on
        if (msg.msg_flags & MSG_TRUNC) {  // the router never sends one this big
            ::close(client);
            continue;
        }
        {
            std::lock_guard<std::mutex> lock(mutex_);
            ++in_flight_;
        }
        bool spawn = false;
        {
            std::lock_guard<std::mutex> lock(pool_mutex_);
            jobs_.emplace_back(std::string(buffer.data(), static_cast<size_t>(n)), client);
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
        auto [message, client] = std::move(jobs_.front());
        jobs_.erase(jobs_.begin());
        lock.unlock();
        serve(std::move(message), client);
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

void Conduit::serve(std::string message, int client) {
    long long id = -1;
    int status = 0;
    bool keep = false;
    std::string error;
    auto stop = std::make_shared<StopFlag>();
    stop->peer = client;
    Writer out{client, *stop};
    std::string name;
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
        const size_t nul = message.find('\0');
        const json h = json::parse(message.substr(0, nul));
        const std::string body = nul == std::string::npos ? std::string() : message.substr(nul + 1);
        message.clear();
        id = h.at("id").get<long long>();
        name = h.at("model").get<std::string>();
        const bool keep_alive = h.value("keep_alive", true);
        std::string extra;  // the router's headers (CORS), as it would have sent them
        for (const auto & kv : h.value("extra", json::array())) {
            extra += kv.at(0).get<std::string>() + ": " + kv.at(1).get<std::string>() + "\r\n";
        }
        const std::string connection = keep_alive ? "" : "Connection: close\r\n";
        std::shared_ptr<Engine> engine;
        int awaited = 0;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            auto it = models_.find(name);
            if (it != models_.end() && !it->second.closing) {
                engine = it->second.engine;
                awaited = it->second.awaited;
                it->second.requests.insert(stop);
                registered = true;
                model = &it->second;
            }
        }
        bool left = false;  // the client left while its request waited for a slot
        if (engine && takes_slot(h.at("path").get<std::string>())) {
            std::unique_lock<std::mutex> lock(mutex_);
            holds_slot = enter(*model, *stop, lock);
            if (!holds_slot && model->closing) {
                engine.reset();  // unloading: the 503 below
            } else if (!holds_slot) {
                left = true;
            }
        }
        if (left) {
            status = 499;  // nothing written: the client is gone
        } else if (!engine) {  // unloaded meanwhile: what llama-server says of a model not ready
            status = 503;
            const std::string data = safe_json_to_str(
                {{"error", format_error_response("Loading model", ERROR_TYPE_UNAVAILABLE)}});
            out.write("HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json; charset=utf-8\r\n"
                      "Retry-After: 1\r\n" + extra + connection + "Content-Length: " +
                      std::to_string(data.size()) + "\r\n\r\n" + data);
        } else {
            auto reply = engine->handle(h.at("method").get<std::string>(), h.at("path").get<std::string>(),
                                        string_map(h.value("query", json::object())),
                                        string_map(h.value("headers", json::object())), body,
                                        h.value("query_string", std::string()), stop);
            status = reply->status();
            std::string head = "HTTP/1.1 " + std::to_string(status) + " " + httplib::status_message(status) + "\r\n" +
                               "Content-Type: " + reply->content_type() + "\r\n";
            for (const auto & [k, v] : reply->headers()) head += k + ": " + v + "\r\n";
            head += extra + connection;
            int seen = 0;
            if (!reply->is_stream()) {
                release_slot();  // the whole reply is here: its slot is free
                const std::string & data = reply->data();
                head += "Content-Length: " + std::to_string(data.size()) + "\r\n\r\n";
                out.write(head + data);
                if (awaited > 0) seen = cache_n(data);
            } else {
                head += "Transfer-Encoding: chunked\r\n\r\n";
                Writer::frame(head, reply->data());  // the head and the first chunk in one write
                if (out.write(head)) {
                    std::string chunk;
                    bool more = true;
                    while (more && out.ok) {
                        more = reply->next(chunk);
                        if (!more) release_slot();  // the stream's end: its slot is free
                        if (awaited > 0) seen = std::max(seen, cache_n(chunk));
                        out.chunk(chunk, !more);  // the last chunk and the end in one write
                    }
                }
            }
            keep = keep_alive && out.ok && !stop->stopped();  // before the reply goes: it sets the flag
            reply.reset();  // on_complete, as llama-server's connection ends
            if (seen > 0) {
                std::lock_guard<std::mutex> lock(mutex_);
                auto it = models_.find(name);
                if (it != models_.end() && it->second.awaited > 0) {
                    --it->second.awaited;
                    ++it->second.hits;
                }
            }
        }
        if (!engine && !left) keep = keep_alive && out.ok;
    } catch (const std::exception & e) {
        error = e.what();
        if (out.written == 0 && id >= 0) {  // nothing written yet: say it, as llama-server's ex_wrapper
            status = 500;
            const std::string data = safe_json_to_str({{"error", format_error_response(error, ERROR_TYPE_SERVER)}});
            out.write("HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json; charset=utf-8\r\n"
                      "Connection: close\r\nContent-Length: " + std::to_string(data.size()) + "\r\n\r\n" + data);
        }
        keep = false;
    }
    release_slot();  // where the reply did not end (a stream cut short, an error): after it
    ::close(client);  // the router's descriptor stays: the connection is its own again
    {
        std::lock_guard<std::mutex> lock(mutex_);
        if (registered) {
            auto it = models_.find(name);
            if (it != models_.end()) it->second.requests.erase(stop);
        }
    }
    if (id >= 0) report(id, status, out.written, keep, error);
    {
        std::lock_guard<std::mutex> lock(mutex_);
        --in_flight_;
    }
    done_.notify_all();
}

void Conduit::report(long long id, int status, long long bytes, bool keep, const std::string & error) {
    const std::string msg = safe_json_to_str(
        {{"id", id}, {"status", status}, {"bytes", bytes}, {"keep", keep}, {"error", error}});
    std::lock_guard<std::mutex> lock(send_mutex_);
    while (::send(fd_, msg.data(), msg.size(), MSG_NOSIGNAL) < 0 && errno == EINTR) {
    }
}

}  // namespace pyllmrouter
