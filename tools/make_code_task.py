"""Write the small code task `make demo-code` trains on: string and list functions with assert tests.

Each problem asks for one Python function in words ("Write a Python function
`add_7(xs)` that returns a new list with 7 added to each element of xs.") and
carries 4 assert tests computed from a reference implementation on inputs
drawn with a fixed seed. Families x parameters give a few hundred distinct
problems; every family has problems in both splits, but no function (family
and parameter) is in both. Rows use verl's columns: data_source "code",
prompt as a chat list, reward_model.ground_truth the JSON of the tests in the
`code` reward's assert form (`hybridflow/rewards/code.py`).

    python tools/make_code_task.py [--out hybridflow/assets/code_task] [--seed 0]

Deterministic: the same seed writes the same files.
"""
from __future__ import annotations

import argparse
import json
import random
import string
import sys
from pathlib import Path
from typing import Any, Callable

from hybridflow.data.dataset import write_parquet

ASK = ("{task} Answer with the function only, in a ```python code block.")
WORDS = ["apple", "river", "stone", "cloud", "tiger", "paper", "green", "house", "light", "music", "ocean",
         "plant", "robot", "sugar", "train", "water", "zebra", "bread", "chair", "dream"]


def _word(rng: random.Random) -> str:
    return rng.choice(WORDS) if rng.random() < 0.5 else "".join(rng.choices(string.ascii_lowercase, k=rng.randint(0, 8)))


def _ints(rng: random.Random) -> list[int]:
    return [rng.randint(-20, 30) for _ in range(rng.randint(0, 7))]


def _words(rng: random.Random) -> list[str]:
    return [rng.choice(WORDS) for _ in range(rng.randint(0, 5))]


# family -> (parameters, name(k), description(k), reference(k) -> fn, input drawer); k is the parameter.
Family = tuple[list[Any], Callable[[Any], str], Callable[[Any], str], Callable[[Any], Callable], Callable]
FAMILIES: dict[str, Family] = {
    "add": (list(range(1, 41)), lambda k: f"add_{k}(xs)",
            lambda k: f"returns a new list with {k} added to each element of the list of integers xs",
            lambda k: lambda xs: [x + k for x in xs], _ints),
    "times": (list(range(2, 26)), lambda k: f"times_{k}(xs)",
              lambda k: f"returns a new list with each element of the list of integers xs multiplied by {k}",
              lambda k: lambda xs: [x * k for x in xs], _ints),
    "above": (list(range(-10, 30)), lambda k: f"above_{k}(xs)".replace("-", "minus_"),
              lambda k: f"returns the elements of the list of integers xs that are greater than {k}, in order",
              lambda k: lambda xs: [x for x in xs if x > k], _ints),
    "count_multiples": (list(range(2, 21)), lambda k: f"count_multiples_of_{k}(xs)",
                        lambda k: f"returns how many elements of the list of integers xs are divisible by {k}",
                        lambda k: lambda xs: sum(1 for x in xs if x % k == 0), _ints),
    "first": (list(range(1, 11)), lambda k: f"first_{k}(xs)",
              lambda k: f"returns a list of the first {k} elements of the list xs (all of them if it is shorter)",
              lambda k: lambda xs: xs[:k], _ints),
    "count_char": (list(string.ascii_lowercase), lambda c: f"count_{c}(s)",
                   lambda c: f"returns how many times the letter '{c}' occurs in the string s",
                   lambda c: lambda s: s.count(c), _word),
    "repeat": (list(range(2, 9)), lambda k: f"repeat_chars_{k}(s)",
               lambda k: f"returns the string s with every character repeated {k} times",
               lambda k: lambda s: "".join(ch * k for ch in s), _word),
    "replace": ([(a, b) for a in "aeiou" for b in "xyzq"], lambda p: f"replace_{p[0]}_with_{p[1]}(s)",
                lambda p: f"returns the string s with every '{p[0]}' replaced by '{p[1]}'",
                lambda p: lambda s: s.replace(p[0], p[1]), _word),
    "pad": ([(w, c) for w in range(5, 13) for c in "*.-#"], lambda p: f"pad_{p[0]}_{'star dot dash hash'.split()['*.-#'.index(p[1])]}(s)",
            lambda p: f"returns the string s padded on the left with '{p[1]}' to length {p[0]} (unchanged if it "
                      f"is already that long or longer)",
            lambda p: lambda s: s.rjust(p[0], p[1]), _word),
    "join": (["-", ", ", "+", "/", " "], lambda sep: f"join_{'_'.join(str(ord(ch)) for ch in sep)}(words)",
             lambda sep: f"returns the strings of the list words joined with {sep!r} between them",
             lambda sep: lambda words: sep.join(words), _words),
    "suffix": (["ing", "ed", "s", "ly", "er", "est", "ness", "ful", "less", "able"], lambda x: f"add_{x}(words)",
               lambda x: f"returns a new list with '{x}' appended to each string of the list words",
               lambda x: lambda words: [w + x for w in words], _words),
    "last": (list(range(1, 11)), lambda k: f"last_{k}(xs)",
             lambda k: f"returns a list of the last {k} elements of the list xs (all of them if it is shorter)",
             lambda k: lambda xs: xs[-k:], _ints),
    "below": (list(range(-10, 20)), lambda k: f"below_{k}(xs)".replace("-", "minus_"),
              lambda k: f"returns the elements of the list of integers xs that are less than {k}, in order",
              lambda k: lambda xs: [x for x in xs if x < k], _ints),
    "longer": (list(range(1, 9)), lambda k: f"longer_than_{k}(words)",
               lambda k: f"returns the strings of the list words that have more than {k} characters, in order",
               lambda k: lambda words: [w for w in words if len(w) > k], _words),
}


def make_problem(family: str, k: Any, rng: random.Random) -> dict[str, Any]:
    _, signature, describe, reference, draw = FAMILIES[family]
    name = signature(k).split("(")[0]
    fn, tests, seen = reference(k), [], set()
    while len(tests) < 4:
        arg = draw(rng)
        if repr(arg) in seen:
            continue
        seen.add(repr(arg))
        tests.append(f"assert {name}({arg!r}) == {fn(arg)!r}")
    task = f"Write a Python function `{signature(k)}` that {describe(k)}."
    return {"family": family, "prompt": ASK.format(task=task), "tests": tests}


def generate(seed: int, test_share: float = 0.25) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, test) rows: each family's parameters shuffled and split, so no function is in both."""
    rng = random.Random(seed)
    splits: dict[str, list[dict[str, Any]]] = {"train": [], "test": []}
    for family, (params, *_) in FAMILIES.items():
        order = list(params)
        rng.shuffle(order)
        cut = max(1, round(len(order) * test_share))
        for split, part in (("test", order[:cut]), ("train", order[cut:])):
            for k in part:
                problem = make_problem(family, k, rng)
                splits[split].append({
                    "data_source": "code",
                    "prompt": [{"role": "user", "content": problem["prompt"]}],
                    "ability": "code",
                    "reward_model": {"style": "rule", "ground_truth": json.dumps({"asserts": problem["tests"]})},
                    "extra_info": {"split": split, "index": len(splits[split]), "family": family},
                })
    for rows in splits.values():
        random.Random(seed + 1).shuffle(rows)
        for i, row in enumerate(rows):
            row["extra_info"]["index"] = i
    return splits["train"], splits["test"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "hybridflow" / "assets"
                        / "code_task")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    train, test = generate(args.seed)
    for name, rows in (("train", train), ("test", test)):
        print(f"wrote {len(rows)} {name} problems to {write_parquet(rows, args.out / f'{name}.parquet')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
