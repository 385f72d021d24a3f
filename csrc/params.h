// llama-server's arguments, as llama-server itself resolves them.
//
// parse_server_args() is llama.cpp's parser (common_params_parse,
// LLAMA_EXAMPLE_SERVER) plus what llama-server's main does to the params before
// it builds the context (server.cpp: slots auto, unified KV, the KV pool per
// slot, embeddings' batch), plus the first step of llama.cpp's fit
// (common_fit_params): a context left to llama.cpp (no -c) is the model's
// training context per stream.  The probe and the engine both start here, so
// they build the very same llama params.  server_params() reads back, as plain
// values, what decides memory: the router never restates a default.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

struct common_params;

namespace pyllmrouter {

// Bad arguments for a model: the message names the argument.
class engine_args_error : public std::invalid_argument {
  public:
    using std::invalid_argument::invalid_argument;
};

// llama-server's arguments as llama-server's main and server_context::load_model
// resolve them (llama.cpp's parser; bad ones throw engine_args_error naming them).
// ctx_auto: set to whether the context was left to the fit (which may shrink it).
// resolve_ctx false: leave a context left to the fit at 0, as llama.cpp's fit wants it.
common_params parse_server_args(const std::vector<std::string> & args, bool * ctx_auto = nullptr,
                                bool resolve_ctx = true);

// What the parsed params say about memory, as plain values.
struct ServerParams {
    std::string model;
    std::string hf_repo;
    std::int32_t n_ctx = 0;        // the context llama.cpp is given (0: the training context, fit off)
    bool ctx_auto = false;         // no context was given: llama.cpp's fit may shrink it, down to fit_ctx
    std::int32_t n_ctx_train = 0;  // the model's training context (0: unknown here)
    std::int32_t fit_ctx = 0;      // --fit-ctx per stream (-1: never below the training context)
    bool fit = true;               // --fit: memory may decide layers and context (the router fits)
    std::int32_t n_parallel = 0;
    bool kv_unified = false;
    std::int32_t n_streams = 1;    // KV streams: 1 when unified, else one per slot
    std::int32_t n_batch = 0;
    std::int32_t n_ubatch = 0;
    bool swa_full = false;
    std::string type_k, type_v;
    std::string flash_attn;        // auto, on, off
    std::int32_t n_gpu_layers = -1;  // -1 auto, -2 all
    std::string mmproj;
    bool mmproj_offload = true;
    std::string draft;
    std::int32_t draft_n_gpu_layers = -1;
    std::vector<std::string> lora;
    std::int32_t cache_ram = 0;    // MiB (-1: no limit, 0: off)
    std::int32_t ctx_checkpoints = 0;
    bool embedding = false;
    std::string slot_save_path;
};

ServerParams server_params(const std::vector<std::string> & args);

// llama-server preset keys (long or short option names without dashes, or
// LLAMA_ARG_* names) with their values, as the command-line arguments
// llama-server's router gives a child for them (common_preset::to_args).
// An unknown key throws engine_args_error naming it.
std::vector<std::string> preset_args(const std::vector<std::pair<std::string, std::string>> & keys);

// A preset section's keys split as the router needs them: the model file, its
// aliases, the devices it is pinned to and its draft's (device names in the
// router's own namespace: the router masks and renames them), and every other key
// as llama-server arguments.  (llama-server's router reads a preset's aliases the
// same way.)
struct PresetModel {
    std::vector<std::string> args;
    std::string model;
    bool has_devices = false;
    std::vector<std::string> devices;
    bool has_draft_devices = false;
    std::vector<std::string> draft_devices;
    std::vector<std::string> aliases;  // --alias: the router routes by them, and names the model itself
    std::string hf_repo, hf_file;      // --hf-repo, --hf-file: a model of llama.cpp's cache
};

// A llama-server command line as preset keys, as llama.cpp's own preset machinery reads
// it (common_preset_context::load_from_args): [(key, value)].
std::vector<std::pair<std::string, std::string>> args_to_preset(const std::vector<std::string> & args);

// The files a preset's model and draft come from, where they are repositories of llama.cpp's
// cache (hf-repo [hf-file], spec-draft-hf [spec-draft-model]), resolved as llama-server's
// router resolves them for dedup-cache-models (common_download_resolve_path); "" where none.
std::vector<std::string> preset_hf_paths(const std::vector<std::pair<std::string, std::string>> & keys);

// The router's command line as llama-server's router lays it over every model: without
// the options that are the router's own (server-models.cpp's unset_reserved_args, model
// arguments included, and the log file): TLS files, API keys and key files, the model
// sources, the model limit, autoload, and a model's file, projector, alias and repository.
std::vector<std::string> model_base_args(const std::vector<std::string> & args);

PresetModel preset_model(const std::vector<std::pair<std::string, std::string>> & keys);

// llama.cpp's own fit of these arguments on devices with exactly the room given (by
// device name; "CPU": the host, where no device is given): csrc/peer_fit.cpp.
struct PeerFit {
    int status = 0;  // common_params_fit_status: 0 success, 1 failure, 2 error
    std::int32_t n_ctx = 0;
    std::int32_t n_gpu_layers = 0;
    std::vector<float> tensor_split;
    std::vector<std::pair<std::string, std::string>> overrides;  // (pattern, buffer type)
    double seconds = 0;
    std::vector<std::string> log;  // llama.cpp's log lines of the fit
};

PeerFit llama_fit(const std::vector<std::string> & args, const std::vector<std::pair<std::string, std::uint64_t>> & rooms);

}  // namespace pyllmrouter
