"""Run by test_moe.py in a process of its own (vLLM's parallel state is one per process, and an engine built
after a dense one finds no expert-parallel group): a random Qwen3-MoE (4 experts, top 2) greedy on vLLM,
loaded from its checkpoint on disk, then with the same weights pushed, then with changed weights pushed again
(a second push must repack the experts anew), each against the built-in engine. Prints one line
`MOE {"disk": bool, "pushed": bool, "pushed_again": bool}`: whether each gave the built-in engine's tokens."""
import json
import sys
import tempfile

import torch


def main() -> None:
    import vllm

    from hybridflow.models import save_decoder
    from hybridflow.rollout import Generator, SamplingParams, hf_named
    from hybridflow.rollout.vllm_backend import VLLMBackend
    from tests.rollout.conftest import left_padded_prompts
    from tests.vllm.test_engine import MOE, PAD, VOCAB, _Tok, random_decoder

    model = random_decoder("llama", **MOE)
    path = save_decoder(model, tempfile.mkdtemp() + "/model")
    ids, mask = left_padded_prompts(VOCAB, lengths=(9, 4, 1, 7, 30))
    greedy = SamplingParams(max_new_tokens=12, do_sample=False)
    want = Generator(model, PAD).generate(ids, mask, greedy).responses
    # The KV cache sized as the backend sizes it: vLLM's default reserves 92% of the machine's memory and
    # refuses to start where other processes hold more than 8% of it.
    llm = vllm.LLM(model=str(path), load_format="auto", dtype="float32", enforce_eager=True,
                   skip_tokenizer_init=True, max_model_len=128, kv_cache_memory_bytes=2**28)
    prompts = [{"prompt_token_ids": row[m.bool()].tolist()} for row, m in zip(ids, mask)]
    outs = llm.generate(prompts, vllm.SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    disk = all(list(o.outputs[0].token_ids) == w[:len(o.outputs[0].token_ids)].tolist() for o, w in zip(outs, want))
    del llm
    backend = VLLMBackend(str(path), _Tok(), dtype="float32", max_model_len=128, bucket_bytes=2**20)
    backend.load_weights(hf_named(model))
    pushed = torch.equal(backend.generate(ids, mask, greedy).responses, want)
    with torch.no_grad():  # an update: every expert and router changes
        for name, p in model.named_parameters():
            if ".mlp." in name:
                p.add_(torch.randn_like(p) * 0.5 * p.std())
    again = Generator(model, PAD).generate(ids, mask, greedy).responses
    backend.load_weights(hf_named(model))
    pushed_again = not torch.equal(again, want) and torch.equal(backend.generate(ids, mask, greedy).responses, again)
    print("MOE " + json.dumps({"disk": disk, "pushed": pushed, "pushed_again": pushed_again}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
