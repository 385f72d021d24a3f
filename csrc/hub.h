// llama.cpp's cache of downloaded models: see hub.cpp.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace pyllmrouter {

struct CachedModel {
    std::string name;    // "org/repo:tag"
    std::string path;    // the model's file, resolved offline
    std::string mmproj;  // its projector, if the repository has one
    std::string error;   // why it could not be resolved
};

// Every model in llama.cpp's cache, resolved offline.
std::vector<CachedModel> cached_models();

// Downloads "org/repo[:tag]" into llama.cpp's cache with llama.cpp's downloader, calling
// progress(url, downloaded, total) as it goes, false to cancel (llama.cpp's downloader then
// stops and deletes its partial file); the model's path ("" where llama.cpp's handler found
// none and said nothing: llama-server's router calls that finished too).  Throws naming the
// reason.
// hf_file: one file of the repository (llama-server's --hf-file), else the tag's model.
std::string download_model(const std::string & name,
                           const std::function<bool(const std::string &, std::uint64_t, std::uint64_t)> & progress,
                           const std::string & hf_file = "");

// A model of the cache, resolved offline as llama-server resolves --hf-repo [--hf-file]:
// its file and its projector; throws naming the repository where it is not there.
CachedModel resolve_cached(const std::string & hf_repo, const std::string & hf_file);

// Removes "org/repo[:tag]" from the cache; false if nothing was there.
bool remove_cached(const std::string & name);

// Where llama.cpp's cache is.
std::string cache_dir();

}  // namespace pyllmrouter
