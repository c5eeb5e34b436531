// NPU Studio's GenieX acceptance harness: GenieX's own metadata/spec loader, run on a bundle folder.
#include <cstdio>
#include <exception>
#include <string>
#include "llm/llm_spec_loader.h"

int main(int argc, char** argv) {
    if (argc != 2) { std::fprintf(stderr, "usage: harness BUNDLE_DIR\n"); return 2; }
    const std::filesystem::path dir(argv[1]);
    try {
        auto cfg  = geniex::modelConfigFromDirectory(dir);
        auto meta = geniex::parseQAIRTMetadata(dir);
        auto gc   = geniex::parseGenieConfig(dir);
        auto spec = geniex::buildSpec(meta, gc);
        auto emb  = geniex::makeEmbeddingProvider(meta, gc);
        auto rope = geniex::makeRoPEProvider(meta, gc);
        std::printf("{\"model_id\": \"%s\", \"shards\": %zu, \"hidden_size\": %zu, \"num_kv_heads\": %zu, "
                    "\"head_dim\": %zu, \"vocab_size\": %zu, \"num_hidden_layers\": %zu, \"first_input\": \"%s\", "
                    "\"eos\": %zu, \"bos\": %d, \"rope_theta\": %g, \"model_paths\": %zu, \"dialog_type\": \"%s\"}\n",
                    meta.model_id.c_str(), meta.shards.size(), spec.hidden_size, spec.num_kv_heads, spec.head_dim,
                    spec.vocab_size, meta.num_hidden_layers, meta.first_shard_input_hint.c_str(),
                    spec.eos_token_ids.size(), spec.bos_token_id, gc.rope_theta, cfg.model_paths.size(),
                    gc.dialog_type.c_str());
    } catch (const std::exception& e) {
        std::printf("{\"error\": \"%s\"}\n", e.what());
        return 1;
    }
    return 0;
}
