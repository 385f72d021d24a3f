// Exact memory probe over libllama/libggml: no Python in here.
//
// probe_file() builds a model and a context with no_alloc (and load mode NONE:
// the default mmap mode with no_alloc aborts), reads llama.cpp's own per
// buffer-type breakdown of what a real load would allocate, and frees both.
// breakdown_of() reads the same breakdown from a live context, so a
// prediction and the real thing can be compared in one process.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

struct llama_context;
struct llama_model;
struct llama_model_params;
struct llama_context_params;

namespace pyllmrouter {

// Raised for every failure; the message names the file and the reason.
class probe_error : public std::runtime_error {
  public:
    using std::runtime_error::runtime_error;
};

// Bytes in one backend buffer type. `device` is the ggml device that owns the
// buffer type; `host` says the bytes live in system memory (CPU, CUDA_Host...).
struct BufferRow {
    std::string buffer_type;
    std::string device;
    bool host = false;
    std::uint64_t model = 0;
    std::uint64_t context = 0;
    std::uint64_t compute = 0;
    std::uint64_t output = 0;  // logits/embeddings buffer: not in llama.cpp's breakdown
    std::uint64_t projector = 0;  // multimodal projector (mmproj): weights and compute
    std::uint64_t checkpoints = 0;  // llama-server's context checkpoints of every slot, at their cap
    std::string component = "model";  // "model" (the model and its context), "draft", "projector"
};

struct ModelFacts {
    std::string architecture;
    std::string name;
    std::int32_t n_layer = 0;
    std::int32_t n_ctx_train = 0;
    std::int32_t n_embd = 0;
    std::int32_t n_head = 0;
    std::int32_t n_expert = 0;
    std::int32_t n_vocab = 0;
    std::uint64_t n_params = 0;
    std::uint64_t model_size = 0;
    std::vector<std::string> devices;  // devices the model is split over
};

struct ProbeResult {
    std::vector<BufferRow> rows;
    ModelFacts facts;
    std::uint32_t n_ctx = 0;
    std::uint32_t n_seq_max = 0;
    std::vector<std::string> log;  // llama.cpp's log lines during the probe
};

struct DeviceInfo {
    int index = 0;
    std::string name;
    std::string description;
    std::string type;  // cpu, gpu, igpu, accel
    std::uint64_t free = 0;
    std::uint64_t total = 0;
};

// A scalar GGUF key: integers, floats, bools and strings; arrays as their length.
using MetaValue = std::pair<char, std::string>;  // ('i'|'f'|'b'|'s'|'a', text)

// n_outputs: rows of the output buffer to reserve (n_seq_max for generation,
// n_batch when every token of a batch yields logits or an embedding); loras: LoRA
// adapter files loaded with the model (rows of component "lora"); checkpoints: the
// context checkpoints llama-server keeps per slot (--ctx-checkpoints), counted in
// host memory at their cap where the engine would make them.
ProbeResult probe_file(const std::string & path, const llama_model_params & mparams,
                       const llama_context_params & cparams, std::uint32_t n_outputs,
                       const std::vector<std::string> & loras = {}, std::uint32_t checkpoints = 0);

// The bytes of one context checkpoint of one slot at its largest (csrc/checkpoints.cpp):
// the SWA window's cells, or the recurrent state; 0 where the engine makes none.
std::uint64_t checkpoint_bytes(const llama_context * ctx, const llama_context_params & cparams);

// The model's training context ({arch}.context_length) from its GGUF header, 0 if
// the file cannot be read; remembered per file (path, size, modification time).
std::uint32_t n_ctx_train_of(const std::string & path);

// A LoRA adapter's bytes per buffer type for `model` (csrc/lora.cpp); throws
// probe_error naming the file.
std::vector<BufferRow> lora_rows(const llama_model * model, const std::string & path);

std::vector<BufferRow> breakdown_of(const llama_context * ctx);

// Writes to `dest` the header of the single-file GGUF `src` with its vocabulary's
// content left out: the tokenizer keys go, "tokenizer.ggml.model" becomes "no_vocab"
// and "{arch}.vocab_size" the number of tokens (llama.cpp then makes that many
// placeholder tokens instead of building a tokenizer); every other key and the
// tensor table stay, and the data region is a sparse hole of the same size, so
// what a no_alloc load allocates is unchanged.  Returns false, writing nothing,
// where it does not apply: an unreadable header, a split model, no token list, or
// tensor data past the end of the file (the real file then gives the real error).
bool write_vocab_free_header(const std::string & src, const std::string & dest);

std::vector<DeviceInfo> list_devices();

// Runs fn with the llama.cpp and ggml log lines of the calling thread captured
// ("E text", "W text", ...), and returns them; other threads log as before.
std::vector<std::string> capture_log(const std::function<void()> & fn);
// The same lines, recorded while they also go where they would have gone (the log as usual).
std::vector<std::string> tee_log(const std::function<void()> & fn);

// Routes llama.cpp's log (and ggml's) through this library from now on, passing
// on to the callback installed before only lines of level >= floor (a
// ggml_log_level; a continuation keeps its line's level).
void route_log(int floor);

// Handles for llama_model_params: a device by ggml name ("CUDA0", "RPC0"), a
// buffer type by name ("CPU", "CUDA0", "CUDA_Host"). Unknown names throw and
// list the known ones.
void * device_handle(const std::string & name);
void * buffer_type_handle(const std::string & name);

std::map<std::string, MetaValue> gguf_metadata(const std::string & path);

// (name, bytes) of every tensor in a GGUF file, from its header alone.
std::vector<std::pair<std::string, std::uint64_t>> tensor_sizes(const std::string & path);

// Attach ggml rpc-servers ("host:port") as devices of this process; returns the
// names of the devices added, in order. Throws if the RPC backend is missing.
std::vector<std::string> add_rpc_servers(const std::vector<std::string> & endpoints);

}  // namespace pyllmrouter
