// llama.cpp's cache of downloaded models (-hf), through llama.cpp's own downloader:
// what llama-server's router lists with "source: cache", pulls on POST /models and
// removes on DELETE /models.  The Hugging Face endpoint is llama.cpp's to choose
// (MODEL_ENDPOINT, HF_ENDPOINT), and so is the cache's place (LLAMA_CACHE, HF_HUB_CACHE,
// HF_HOME...).  Run in short-lived processes: the router process never loads llama.cpp.
#include "hub.h"

#include <stdexcept>

#include "arg.h"
#include "common.h"
#include "download.h"

namespace pyllmrouter {
namespace {

// A repository with an optional tag, as llama-server takes it ("org/repo:Q4_K_M").
common_params hf_params(const std::string & name, bool offline) {
    common_params p;
    p.model.hf_repo = name;
    p.offline = offline;
    p.hf_token = common_get_env("HF_TOKEN");
    return p;
}

// Progress to the caller, and the caller's cancel to llama.cpp's downloader (is_cancelled:
// it stops the transfer and removes its .downloadInProgress file).
struct ProgressRelay : common_download_callback {
    const std::function<bool(const std::string &, std::uint64_t, std::uint64_t)> & report;
    bool cancelled = false;
    explicit ProgressRelay(const std::function<bool(const std::string &, std::uint64_t, std::uint64_t)> & r)
        : report(r) {}
    void relay(const common_download_progress & p) { cancelled = !report(p.url, p.downloaded, p.total) || cancelled; }
    void on_start(const common_download_progress & p) override { relay(p); }
    void on_update(const common_download_progress & p) override { relay(p); }
    void on_done(const common_download_progress & p, bool) override { relay(p); }
    bool is_cancelled() const override { return cancelled; }
};

}  // namespace

std::vector<CachedModel> cached_models() {
    std::vector<CachedModel> out;
    for (const auto & m : common_list_cached_models()) {
        CachedModel c;
        c.name = m.to_string();
        try {  // resolved offline, as llama-server's router resolves a cached model's files
            common_params p = hf_params(c.name, /*offline =*/true);
            common_models_handler handler = common_models_handler_init(p, LLAMA_EXAMPLE_SERVER);
            common_models_handler_apply(handler, p);
            c.path = p.model.path;
            c.mmproj = p.mmproj.path;
        } catch (const std::exception & e) {
            c.error = e.what();
        }
        out.push_back(c);
    }
    return out;
}

std::string download_model(const std::string & name,
                           const std::function<bool(const std::string &, std::uint64_t, std::uint64_t)> & progress,
                           const std::string & hf_file) {
    common_params p = hf_params(name, /*offline =*/false);
    p.model.hf_file = hf_file;
    common_models_handler handler = common_models_handler_init(p, LLAMA_EXAMPLE_SERVER);
    ProgressRelay relay(progress);
    common_models_handler_apply(handler, p, &relay);
    if (relay.cancelled) {
        throw std::runtime_error("the download of " + name + " was cancelled");
    }
    // llama-server's router says a pull finished when llama.cpp's handler returned, whether or
    // not a model file came (server_download_state::run); "" then
    return p.model.path;
}

CachedModel resolve_cached(const std::string & hf_repo, const std::string & hf_file) {
    common_params p = hf_params(hf_repo, /*offline =*/true);
    p.model.hf_file = hf_file;
    common_models_handler handler = common_models_handler_init(p, LLAMA_EXAMPLE_SERVER);
    common_models_handler_apply(handler, p);
    if (p.model.path.empty()) {
        throw std::runtime_error(hf_repo + (hf_file.empty() ? "" : " " + hf_file) +
                                 ": not in llama.cpp's cache (pull it first: POST /models)");
    }
    CachedModel c;
    c.name = hf_repo;
    c.path = p.model.path;
    c.mmproj = p.mmproj.path;
    return c;
}

bool remove_cached(const std::string & name) {
    return common_download_remove(name);
}

std::string cache_dir() {
    return hf_cache::get_cache_path();
}

}  // namespace pyllmrouter
