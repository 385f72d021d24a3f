// The size of one of llama-server's context checkpoints at its largest.
//
// llama-server keeps up to --ctx-checkpoints copies per slot, in host memory, of
// the part of a sequence's memory it cannot roll back (server-context.cpp,
// create_checkpoint): llama_state_seq_get_size_ext(ctx, seq,
// LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY).  That is the sliding-window cache of a
// model with SWA (cells outside the window are not written, so a sequence has
// at most n_swa of them), or the recurrent state of a recurrent or hybrid model.
// The bytes below are what the state writers of src/llama-kv-cache.cpp and
// src/llama-memory-recurrent.cpp write for a sequence at that cap: nothing is
// allocated and no tensor is read.
//
// Like lora.cpp, this translation unit sees llama.cpp's internal headers (the
// hyper-parameters per layer, which libllama exports).
#include "probe.h"

#include <algorithm>
#include <cstdint>

#include "ggml.h"
#include "llama-kv-cells.h"
#include "llama-model.h"

namespace pyllmrouter {
namespace {

// llama_kv_cache::state_write of one sequence holding `cells` cells, over the layers
// `swa` selects (PARTIAL_ONLY writes only the SWA cache of an iSWA memory).
std::uint64_t kv_state_bytes(const llama_hparams & hp, std::uint32_t cells, std::uint32_t n_stream,
                             ggml_type type_k, ggml_type type_v) {
    std::uint64_t bytes = sizeof(std::uint32_t);                              // n_stream
    bytes += static_cast<std::uint64_t>(n_stream) * sizeof(std::uint32_t);    // cell_count per stream
    const bool ext = hp.n_pos_per_embd() > 1 || hp.ple_n_heads > 0;
    bytes += static_cast<std::uint64_t>(cells) *
             (sizeof(llama_pos) + sizeof(std::uint32_t) + (ext ? sizeof(llama_kv_cell_ext) : 0) + sizeof(llama_seq_id));
    bytes += 2 * sizeof(std::uint32_t);                                       // v_trans, n_layer
    for (std::uint32_t il = 0; il < hp.n_layer(); ++il) {
        if (!hp.is_swa(il) || !hp.has_kv(il)) continue;
        // a K row and a V row per cell, each after 12 bytes of type and size (the
        // transposed V writes type, element size and width: 12 bytes as well)
        bytes += 12 + static_cast<std::uint64_t>(cells) * ggml_row_size(type_k, hp.n_embd_k_gqa(il));
        bytes += 12 + static_cast<std::uint64_t>(cells) * ggml_row_size(type_v, hp.n_embd_v_gqa(il));
    }
    return bytes;
}

// llama_memory_recurrent::state_write of one sequence (one cell of r and s states,
// f32, per recurrent layer).
std::uint64_t recurrent_state_bytes(const llama_hparams & hp, bool hybrid) {
    std::uint64_t bytes = sizeof(std::uint32_t);                      // cell_count
    bytes += sizeof(llama_pos) + sizeof(std::uint32_t);               // the cell's pos and n_seq_id (0)
    bytes += 2 * sizeof(std::uint32_t);                               // s_trans, n_layer
    for (std::uint32_t il = 0; il < hp.n_layer(); ++il) {
        if (hybrid && !hp.is_recr(il)) continue;
        bytes += 12 + ggml_row_size(GGML_TYPE_F32, hp.n_embd_r());
        if (hp.ple_conv_state() > 0) bytes += 8 + ggml_row_size(GGML_TYPE_F32, hp.ple_conv_state());
        bytes += 12 + ggml_row_size(GGML_TYPE_F32, hp.n_embd_s());
    }
    return bytes;
}

}  // namespace

std::uint64_t checkpoint_bytes(const llama_context * ctx, const llama_context_params & cparams) {
    const llama_model * model = llama_get_model(ctx);
    const llama_hparams & hp = model->hparams;
    if (llama_model_is_recurrent(model) || llama_model_is_hybrid(model)) {
        return recurrent_state_bytes(hp, llama_model_is_hybrid(model));
    }
    if (cparams.swa_full || hp.n_swa == 0 || !hp.is_swa_any()) {
        return 0;  // every cell can be rolled back: no checkpoint
    }
    // the SWA cache's size (llama-kv-cache-iswa.cpp) bounds what a sequence can hold
    const std::uint32_t n_seq = std::max<std::uint32_t>(1, llama_n_seq_max(ctx));
    const std::uint32_t size_base = llama_n_ctx_seq(ctx);
    const std::uint32_t size_swa =
        GGML_PAD(std::min(size_base, hp.n_swa * (cparams.kv_unified ? n_seq : 1) + llama_n_ubatch(ctx)), 256);
    const std::uint32_t window = hp.swa_type == LLAMA_SWA_TYPE_SYMMETRIC ? hp.n_swa + 1 : hp.n_swa;
    const std::uint32_t n_stream = cparams.kv_unified ? 1 : n_seq;
    return kv_state_bytes(hp, std::min(window, size_swa), n_stream, cparams.type_k, cparams.type_v);
}

}  // namespace pyllmrouter
