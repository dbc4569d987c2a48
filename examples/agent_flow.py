"""A multi-turn DataFlow: a rollout node that talks to a calculator over several turns, then a reward node.

    python examples/agent_flow.py --prompts "['What is 347 * 68?']" --truths "['23596']"
    python examples/agent_flow.py --data data/calculator/test.parquet --limit 50 \
        --model models/smollm2-135m-instruct --model runs/demo-agent/hf_actor --examples 2

The rollout node is `Node(name="rollout", model=load_hf_model(path), env=make_calculator_env)`: each prompt
becomes an episode (the model's turns, the calculator's answers, the environment's reward). The reward
node reads that reward. With several `--model`s the same held-out prompts run through each, and a table
gives per model the accuracy (final answer right), the rate of episodes with a well-formed calculator
call, the rate with a malformed one, and the mean number of turns: `make demo-agent` prints it for the
model before and after training. Greedy decoding; `--max-turns` and `--max-turn-tokens` bound an episode.
"""
from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

from hybridflow import DataFlow, Node
from hybridflow.envs import make_calculator_env
from hybridflow.rollout.agent import AgentLimits, agent_forward
from hybridflow.utils import load_hf_model

DEFAULT_MODEL = "models/smollm2-135m-instruct"


def build_flow(model_path: str, limits: AgentLimits | None = None) -> DataFlow:
    """rollout (the agent loop against the calculator) -> reward (the environment's reward of each episode)."""
    model = load_hf_model(model_path)
    if limits is None:
        rollout_node = Node(name="rollout", model=model, env=make_calculator_env)
    else:  # the same loop with limits of one's own
        rollout_node = Node(name="rollout", model=model, forward_fn=agent_forward(make_calculator_env, limits))
    reward_node = Node(name="reward", forward_fn=lambda _, pairs: [episode.reward for _, episode in pairs])
    return DataFlow(nodes=[rollout_node, reward_node], edges=[(rollout_node, reward_node)])


def read_items(path: Path, limit: int) -> list[dict]:
    """The first `limit` prompts of a parquet/jsonl file in verl's columns, as agent items."""
    import pyarrow.parquet as pq

    rows = pq.read_table(path).to_pylist() if path.suffix == ".parquet" else \
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{"prompt": list(r["prompt"]), "ground_truth": r["reward_model"]["ground_truth"]} for r in rows[:limit]]


def summary(episodes: list) -> dict[str, float]:
    n = max(len(episodes), 1)
    return {"accuracy": sum(e.reward >= 1.0 for e in episodes) / n,
            "well_formed_call": sum(e.stats.get("tool_calls", 0) > 0 for e in episodes) / n,
            "malformed_call": sum(e.stats.get("malformed_calls", 0) > 0 for e in episodes) / n,
            "turns": sum(e.turns for e in episodes) / n}


def show(item, episode) -> str:
    prompt = item["prompt"] if isinstance(item, dict) else item
    question = prompt if isinstance(prompt, str) else prompt[-1]["content"]
    lines = [f"--- {question}  (reward {episode.reward:g}, ended: {episode.ended})"]
    lines += [f"  [{m['role']}] {m['content']}" for m in episode.messages]
    return "\n".join(lines)


def parse_list(text: str) -> list[str]:
    value = ast.literal_eval(text)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a Python list of strings, got {text!r}")
    return value


def main(argv=None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description="Multi-turn episodes against a calculator, then their rewards.")
    parser.add_argument("--model", action="append", help=f"HF causal LM directory (repeatable; default {DEFAULT_MODEL})")
    parser.add_argument("--prompts", type=parse_list, help="a Python list of questions")
    parser.add_argument("--truths", type=parse_list, help="their answers, for the reward")
    parser.add_argument("--data", type=Path, help="a parquet/jsonl prompt file (verl's columns) instead of --prompts")
    parser.add_argument("--limit", type=int, default=50, help="prompts read from --data")
    parser.add_argument("--max-turns", type=int, default=None)
    parser.add_argument("--max-turn-tokens", type=int, default=None)
    parser.add_argument("--examples", type=int, default=2, help="episodes printed per model")
    parser.add_argument("--json", type=Path, help="write the table here")
    args = parser.parse_args(argv)
    if args.data is not None:
        items = read_items(args.data, args.limit)
    elif args.prompts:
        truths = args.truths or [None] * len(args.prompts)
        if len(truths) != len(args.prompts):
            parser.error(f"--truths has {len(truths)} answers for {len(args.prompts)} prompts")
        items = [{"prompt": p, "ground_truth": t} for p, t in zip(args.prompts, truths)]
    else:
        parser.error("give --prompts or --data")
    limits = None
    if args.max_turns or args.max_turn_tokens:
        turn = args.max_turn_tokens or 128
        limits = AgentLimits(args.max_turns or 4, turn, (args.max_turns or 4) * (turn + 64))
    table = {}
    for path in args.model or [DEFAULT_MODEL]:
        result = build_flow(path, limits).run(items)
        print(result.report())
        episodes = [episode for _, episode in result.outputs["rollout"]]
        for item, episode in result.outputs["rollout"][:args.examples]:
            print(show(item, episode))
        table[path] = summary(episodes)
    print(f"{'model':<40} {'accuracy':>9} {'tool call':>10} {'malformed':>10} {'turns':>6}")
    for path, row in table.items():
        print(f"{path:<40} {row['accuracy']:>9.1%} {row['well_formed_call']:>10.1%} {row['malformed_call']:>10.1%} "
              f"{row['turns']:>6.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps(table, indent=2) + "\n")
    return table


if __name__ == "__main__":
    main()
