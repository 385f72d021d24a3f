// llama-server's arguments as llama-server resolves them: see params.h.
#include "params.h"

#include <algorithm>
#include <map>
#include <set>

#include "arg.h"
#include "chat.h"
#include "common.h"
#include "ggml.h"
#include "preset.h"
#include "download.h"
#include "speculative.h"
#include "probe.h"

namespace pyllmrouter {
namespace {

// Arguments that print and exit in llama.cpp's parser: never for a served model.
const std::set<std::string> & exiting_args() {
    static const std::set<std::string> s = {"-h", "--help", "--usage", "--version", "-cl", "--cache-list",
                                            "--completion-bash", "--list-devices"};
    return s;
}

// Checks every argument the way llama.cpp's parser applies it, on scratch
// params, so that a bad one is an exception naming it (the parser itself
// prints to stderr, or exits the process on some errors).
void check_args(int argc, char ** argv) {
    for (int i = 1; i < argc; ++i) {
        if (exiting_args().count(argv[i])) {
            throw engine_args_error(std::string(argv[i]) + ": not accepted for a served model");
        }
    }
    std::map<common_arg, std::string> given;
    try {
        common_params_to_map(argc, argv, LLAMA_EXAMPLE_SERVER, given);
    } catch (const std::exception & e) {
        throw engine_args_error(e.what());
    }
    // llama-server's defaults (the parser sets a few per program), made once: the
    // handlers are the options' own, from the map
    static const common_params defaults = [] {
        common_params p;
        common_params_parser_init(p, LLAMA_EXAMPLE_SERVER);
        return p;
    }();
    common_params scratch = defaults;
    for (const auto & [opt, value] : given) {
        const std::string name = opt.args.empty() ? std::string(opt.args_neg.front()) : std::string(opt.args.front());
        try {
            if (opt.handler_string) {
                opt.handler_string(scratch, value);
            } else if (opt.handler_int) {
                opt.handler_int(scratch, std::stoi(value));
            } else if (opt.handler_bool) {
                opt.handler_bool(scratch, common_arg_utils::is_truthy(value));
            } else if (opt.handler_void) {
                opt.handler_void(scratch);
            }
        } catch (const std::exception & e) {
            throw engine_args_error("argument " + name + " = '" + value + "': " + e.what());
        }
    }
    if (!scratch.chat_template.empty() && !common_chat_verify_template(scratch.chat_template, scratch.use_jinja)) {
        throw engine_args_error("chat template is not supported: " + scratch.chat_template);
    }
}

std::int32_t n_streams_of(const common_params & p) {
    return p.kv_unified ? 1 : std::max<std::int32_t>(1, p.n_parallel);
}

const char * flash_attn_name(llama_flash_attn_type t) {
    switch (t) {
        case LLAMA_FLASH_ATTN_TYPE_ENABLED:  return "on";
        case LLAMA_FLASH_ATTN_TYPE_DISABLED: return "off";
        default:                             return "auto";
    }
}

// A preset's option by one of its command-line names.
bool named(const common_arg & opt, const char * name) {
    return std::any_of(opt.args.begin(), opt.args.end(), [name](const char * a) { return std::string(a) == name; });
}

std::vector<std::string> split_names(const std::string & value) {
    std::vector<std::string> out;
    size_t start = 0;
    while (start <= value.size()) {
        size_t end = value.find(',', start);
        if (end == std::string::npos) end = value.size();
        std::string item = value.substr(start, end - start);
        item.erase(0, item.find_first_not_of(" \t"));
        item.erase(item.find_last_not_of(" \t") + 1);
        if (!item.empty()) out.push_back(item);
        start = end + 1;
    }
    return out;
}

// llama-server's argv for `args`: the program name first, null-terminated (common's
// parsers take argc and argv).
struct ServerArgv {
    explicit ServerArgv(const std::vector<std::string> & args) : words{"llama-server"} {
        words.insert(words.end(), args.begin(), args.end());
        for (auto & w : words) pointers.push_back(w.data());
        pointers.push_back(nullptr);
    }
    int argc() const { return static_cast<int>(words.size()); }
    char ** argv() { return pointers.data(); }

  private:
    std::vector<std::string> words;
    std::vector<char *> pointers;
};

// llama.cpp's preset of a command line (its own parser); a refusal is engine_args_error.
common_preset preset_from_args(const std::vector<std::string> & args) {
    static const common_preset_context ctx(LLAMA_EXAMPLE_SERVER);
    ServerArgv argv(args);
    try {
        return ctx.load_from_args(argv.argc(), argv.argv());
    } catch (const std::exception & e) {
        throw engine_args_error(e.what());
    }
}

common_preset preset_of(const std::vector<std::pair<std::string, std::string>> & keys) {
    static const common_preset_context ctx(LLAMA_EXAMPLE_SERVER);
    common_preset preset;
    for (const auto & [key, value] : keys) {
        auto it = ctx.key_to_opt.find(key);
        if (it == ctx.key_to_opt.end()) {
            throw engine_args_error("unknown key '" + key + "'");
        }
        const common_arg & opt = it->second;
        std::string v = value;
        for (const auto & neg : opt.args_neg) {  // as load_from_ini: "no-mmap = true" is mmap false
            std::string bare(neg);
            bare.erase(0, bare.find_first_not_of('-'));
            if (bare == key) v = common_arg_utils::is_truthy(value) ? "false" : "true";
        }
        preset.options[opt] = v;
    }
    return preset;
}

}  // namespace

common_params parse_server_args(const std::vector<std::string> & args, bool * ctx_auto, bool resolve_ctx) {
    ServerArgv argv(args);
    check_args(argv.argc(), argv.argv());
    common_params params;
    if (!common_params_parse(argv.argc(), argv.argv(), params, LLAMA_EXAMPLE_SERVER)) {
        throw engine_args_error("llama.cpp's parser refused the arguments");
    }
    // what llama_server() does to params before it builds the context (server.cpp)
    if (params.embedding && params.n_batch > params.n_ubatch) {
        params.n_batch = params.n_ubatch;
    }
    if (params.n_parallel < 0) {
        params.n_parallel = 4;
        params.kv_unified = true;
    }
    const bool ctx_pool_auto_sized = params.kv_unified_per_slot > 0 && params.n_ctx == 0 &&
                                     (uint32_t) params.fit_params_min_ctx != UINT32_MAX;
    if (ctx_pool_auto_sized) {
        params.n_ctx = params.n_parallel * params.kv_unified_per_slot;
    }
    auto model_name = params.model.get_name();
    if (params.model_alias.empty() && !model_name.empty()) {
        params.model_alias.insert(model_name);
    }
    // the output limits server_context::load_model sets before it builds anything, the fit's
    // measurements included (server_output_limits, server-context.cpp)
    if (params.embedding ||
        (params.pooling_type != LLAMA_POOLING_TYPE_UNSPECIFIED && params.pooling_type != LLAMA_POOLING_TYPE_NONE)) {
        params.n_outputs_max = params.n_batch;
        params.n_outputs_max_per_seq = 1;
    } else {
        auto limits = common_speculative_get_output_limits(params.n_batch, params.n_parallel,
                                                           common_speculative_n_max(&params.speculative));
        params.n_outputs_max = std::max<int32_t>(1, limits.total);
        params.n_outputs_max_per_seq = std::max<int32_t>(1, limits.per_seq);
    }
    // the first step of llama.cpp's fit (common_fit_params, which common_init_from_params
    // runs when --fit is on): a context left to it is the training context per stream,
    // resolved before anything is measured.  (The router fits from here on: the engine
    // itself loads with its fit off.)
    if (ctx_auto != nullptr) *ctx_auto = false;
    if (resolve_ctx && params.fit_params && params.n_ctx == 0) {
        const std::uint64_t train = n_ctx_train_of(params.model.path);
        if (train > 0) {
            params.n_ctx = static_cast<int32_t>(std::min<std::uint64_t>(train * n_streams_of(params), INT32_MAX));
            // the fit may shrink it, unless -c 0 asked for the whole training context
            if (ctx_auto != nullptr) *ctx_auto = (uint32_t) params.fit_params_min_ctx != UINT32_MAX;
        }
    }
    return params;
}

ServerParams server_params(const std::vector<std::string> & args) {
    bool ctx_auto = false;
    const common_params p = parse_server_args(args, &ctx_auto);
    ServerParams s;
    s.model = p.model.path;
    s.hf_repo = p.model.hf_repo;
    s.n_ctx = p.n_ctx;
    s.n_ctx_train = static_cast<std::int32_t>(n_ctx_train_of(p.model.path));
    s.n_streams = n_streams_of(p);
    s.ctx_auto = ctx_auto;
    s.fit = p.fit_params;
    s.fit_ctx = (uint32_t) p.fit_params_min_ctx == UINT32_MAX ? -1 : p.fit_params_min_ctx;
    s.n_parallel = p.n_parallel;
    s.kv_unified = p.kv_unified;
    s.n_batch = p.n_batch;
    s.n_ubatch = p.n_ubatch;
    s.swa_full = p.swa_full;
    s.type_k = ggml_type_name(p.cache_type_k);
    s.type_v = ggml_type_name(p.cache_type_v);
    s.flash_attn = flash_attn_name(p.flash_attn_type);
    s.n_gpu_layers = p.n_gpu_layers;
    s.mmproj = p.mmproj.path;
    s.mmproj_offload = p.mmproj_use_gpu;
    s.draft = p.speculative.draft.mparams.path;
    s.draft_n_gpu_layers = p.speculative.draft.n_gpu_layers;
    for (const auto & lora : p.lora_adapters) s.lora.push_back(lora.path);
    s.cache_ram = p.cache_ram_mib;
    s.ctx_checkpoints = p.n_ctx_checkpoints;
    s.embedding = p.embedding;
    s.slot_save_path = p.slot_save_path;
    return s;
}

std::vector<std::string> preset_args(const std::vector<std::pair<std::string, std::string>> & keys) {
    const common_preset preset = preset_of(keys);
    try {
        return preset.to_args();
    } catch (const std::exception & e) {
        throw engine_args_error(e.what());
    }
}

PresetModel preset_model(const std::vector<std::pair<std::string, std::string>> & keys) {
    common_preset preset = preset_of(keys);
    PresetModel out;
    for (auto it = preset.options.begin(); it != preset.options.end();) {
        const common_arg & opt = it->first;
        if (named(opt, "--model")) {
            out.model = it->second;
        } else if (named(opt, "--device")) {
            out.has_devices = true;
            out.devices = split_names(it->second);
        } else if (named(opt, "--spec-draft-device")) {
            out.has_draft_devices = true;
            out.draft_devices = split_names(it->second);
        } else if (named(opt, "--alias")) {
            out.aliases = split_names(it->second);
        } else if (named(opt, "--hf-repo")) {
            out.hf_repo = it->second;
        } else if (named(opt, "--hf-file")) {
            out.hf_file = it->second;
        } else {
            ++it;
            continue;
        }
        it = preset.options.erase(it);
    }
    try {
        out.args = preset.to_args();
    } catch (const std::exception & e) {
        throw engine_args_error(e.what());
    }
    return out;
}

std::vector<std::pair<std::string, std::string>> args_to_preset(const std::vector<std::string> & args) {
    const common_preset preset = preset_from_args(args);
    std::vector<std::pair<std::string, std::string>> out;
    for (const auto & [opt, value] : preset.options) {
        std::string key = opt.args.back();
        key.erase(0, key.find_first_not_of('-'));
        out.emplace_back(key, value);
    }
    return out;
}

std::vector<std::string> preset_hf_paths(const std::vector<std::pair<std::string, std::string>> & keys) {
    const common_preset preset = preset_of(keys);
    std::vector<std::string> out;
    for (const auto & [repo_env, file_env] : {std::pair{"LLAMA_ARG_HF_REPO", "LLAMA_ARG_HF_FILE"},
                                              std::pair{"LLAMA_ARG_SPEC_DRAFT_HF_REPO", "LLAMA_ARG_SPEC_DRAFT_MODEL"}}) {
        std::string repo, file;
        if (preset.get_option(repo_env, repo) && !repo.empty()) {
            preset.get_option(file_env, file);
            out.push_back(common_download_resolve_path(repo, file));
        }
    }
    return out;
}

std::vector<std::string> model_base_args(const std::vector<std::string> & args) {
    if (args.empty()) {
        return {};
    }
    common_preset preset = preset_from_args(args);
    // server-models.cpp's unset_reserved_args(preset, true), a static function there (not
    // callable from here), and the log file, which is the router's own too
    for (const char * env : {"LLAMA_ARG_SSL_KEY_FILE", "LLAMA_ARG_SSL_CERT_FILE", "LLAMA_API_KEY",
                             "LLAMA_ARG_API_KEY_FILE", "LLAMA_ARG_MODELS_DIR", "LLAMA_ARG_MODELS_MAX",
                             "LLAMA_ARG_MODELS_PRESET", "LLAMA_ARG_MODELS_AUTOLOAD", "LLAMA_ARG_MODEL",
                             "LLAMA_ARG_MMPROJ", "LLAMA_ARG_ALIAS", "LLAMA_ARG_HF_REPO", "LLAMA_ARG_LOG_FILE"}) {
        preset.unset_option(env);
    }
    try {
        return preset.to_args();
    } catch (const std::exception & e) {
        throw engine_args_error(e.what());
    }
}

}  // namespace pyllmrouter
