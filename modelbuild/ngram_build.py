"""`specfleet models build-ngram`: a 4-gram table of the target's own greedy answers.

The answers come from prompts made here from templates over the five task types (chat, code,
translate, summarize, math) and, with `--teacher`, from the teacher text that `specfleet models
distill` generates (the target's greedy answers to the distillation prompts). Neither draws on
the shared benchmark prompts, so that acceptance measured on those stays honest. The same
arguments and teacher file give the same table.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from inference.runtime import Runtime

TASKS = ("chat", "code", "translate", "summarize", "math")
BUILD_SEED = 20230518
DEFAULT_PROMPTS = 1000
DEFAULT_MAX_NEW_TOKENS = 160
DEFAULT_ORDER = 4

_SUBJECTS = [
    "a lighthouse keeper",
    "honeybees",
    "the Moon",
    "glaciers",
    "a street market",
    "owls",
    "the postal service",
    "a chess club",
    "rain forests",
    "bicycles",
    "a small village",
    "coral reefs",
    "a night train",
    "volunteer firefighters",
    "old maps",
    "desert plants",
    "a public library",
    "paper money",
    "wind turbines",
    "a school orchestra",
    "mountain goats",
    "a ferry crossing",
    "sunflowers",
    "a bakery at dawn",
    "comets",
    "a city park",
    "street musicians",
    "old castles",
    "penguins",
    "a farmers' cooperative",
]
_CHAT = [
    "Tell me something interesting about {subject}.",
    "Can you explain how {subject} work or function, in plain words?",
    "Write a short friendly note to a neighbour about {subject}.",
    "What are two common myths about {subject}?",
    "Describe a typical day for {subject} in three sentences.",
    "What questions would a child ask about {subject}? List three.",
    "Give me a fun fact and a safety tip related to {subject}.",
    "I am nervous about {activity}. Any advice?",
    "How do I get started with {activity} on a small budget?",
    "What mistakes do beginners make when {activity}?",
]
_ACTIVITIES = [
    "learning to swim",
    "baking sourdough",
    "keeping chickens",
    "job interviews",
    "moving abroad",
    "painting with watercolors",
    "learning to drive",
    "hosting a dinner",
    "running a book club",
    "taking night photographs",
    "planting tomatoes",
    "camping alone",
    "learning to knit",
    "starting a podcast",
    "training a puppy",
    "fixing a bicycle",
    "learning to code",
    "writing a diary",
    "growing herbs indoors",
    "training for a 5k",
]
_CODE = [
    "Write a Python function that {python_task}.",
    "Show a short {language} example that {python_task}.",
    "Explain this Python code line by line:\n{snippet}",
    "Write a SQL query that {sql_task}.",
    "What does the {concept} mean in programming? Give a short example.",
    "Write a shell one-liner that {shell_task}.",
]
_PYTHON_TASKS = [
    "reverses the words in a sentence",
    "counts the vowels in a string",
    "returns the largest of three numbers",
    "removes duplicates from a list keeping order",
    "merges two sorted lists",
    "converts Celsius to Fahrenheit",
    "checks if a number is prime",
    "flattens a nested list",
    "computes the factorial of n recursively",
    "finds the most common word in a text",
    "sums the digits of an integer",
    "checks whether two words are anagrams",
    "returns the n-th triangular number",
    "checks whether a year is a leap year",
    "splits a list into chunks of size n",
    "returns the median of a list",
    "capitalizes every word in a sentence",
    "converts a binary string to an integer",
    "finds the longest word in a sentence",
    "counts the words in a file",
]
_LANGUAGES = ["Python", "JavaScript", "Go", "Java", "Rust"]
_SNIPPETS = [
    "total = 0\nfor n in range(1, 11):\n    total += n\nprint(total)",
    "names = ['ana', 'bo']\nupper = [n.upper() for n in names]",
    "def area(w, h):\n    return w * h\nprint(area(3, 4))",
    "with open('notes.txt') as f:\n    lines = f.readlines()",
]
_SQL_TASKS = [
    "lists the ten newest users from a table named users",
    "finds the average salary per department in a table named employees",
    "deletes rows older than one year from a table named logs",
    "joins a customers table with an invoices table on customer_id",
]
_CONCEPTS = [
    "term 'recursion'",
    "word 'variable'",
    "idea of a hash map",
    "term 'API'",
    "keyword 'return'",
    "idea of a loop",
]
_SHELL_TASKS = [
    "counts the lines in every .txt file in a folder",
    "shows the five largest files in the current directory",
    "replaces 'foo' with 'bar' in a file named config.ini",
    "lists the processes that use the most memory",
]
_TRANSLATE = [
    "Translate into {language}: {sentence}",
    "How would you say this in {language}? {sentence}",
    "Please give the {language} translation of: {sentence}",
]
_TARGET_LANGUAGES = ["French", "Spanish", "German", "Italian", "Portuguese", "Dutch"]
_SENTENCES = [
    "The bakery opens at seven.",
    "My sister is learning to play the piano.",
    "Could you close the window, please?",
    "We missed the last bus home.",
    "The children are playing in the garden.",
    "I have lost my umbrella again.",
    "This soup needs a little more salt.",
    "The meeting was moved to Thursday.",
    "Our hotel is next to the river.",
    "He reads the newspaper every morning.",
    "The shop on the corner sells fresh fish.",
    "It is too cold to go swimming.",
    "The library is closed on Sundays.",
    "I am looking for the train station.",
    "She bought a new pair of shoes.",
    "We are having fish for dinner tonight.",
    "The museum has a new exhibition.",
    "Please call me when you arrive.",
    "My grandfather grows apples.",
    "The film starts at half past eight.",
]
_SUMMARIZE = [
    "Give a one-sentence summary: {passage}",
    "Summarize briefly: {passage}",
    "What is the main point of this text? {passage}",
    "Write a headline for this news item: {passage}",
    "Sum up in a few words: {passage}",
    "Summarize this for a ten-year-old: {passage}",
]
_PASSAGES = [
    "A regional airline said it would add evening flights between two coastal cities after "
    "a survey showed strong demand from commuters, and the first flights begin in spring.",
    "Volunteers planted four hundred trees along the river last weekend. Organisers hope the "
    "trees will reduce erosion and give shade to walkers within a few years.",
    "The town museum received a collection of old letters written by a local sailor. "
    "Historians say the letters describe daily life at sea in unusual detail.",
    "A bakery chain will stop using plastic bags next month and offer paper bags for a small "
    "fee. The company says customers supported the change in a recent poll.",
    "Scientists tracking a group of whales found that the animals travelled farther than "
    "expected, crossing nearly three thousand kilometres in six weeks.",
    "The football club announced a new youth academy with free training for children from "
    "low-income families, funded by a partnership with local businesses.",
    "After months of repairs, the old cinema reopened with new seats, a larger screen and a "
    "cafe, and its first week of shows sold out within days.",
    "City engineers tested a new type of road surface that drains rainwater quickly. Early "
    "results show fewer puddles and less noise from traffic.",
    "A ferry company added two electric boats to its fleet, cutting fuel costs and noise on the "
    "short crossing between the island and the mainland, and plans to replace its remaining diesel"
    " ferries by the end of the decade.",
    "The regional hospital opened a new children's wing with brighter rooms, a play area and beds "
    "for parents, after a fundraising campaign that lasted three years.",
    "Farmers in the valley reported a record apple harvest this autumn thanks to a mild spring, "
    "although prices fell because so much fruit reached the market at once.",
    "A primary school introduced a weekly gardening lesson. Teachers say pupils now eat more "
    "vegetables at lunch and enjoy learning about insects and soil.",
    "The national park will limit the number of daily visitors during the summer to protect "
    "nesting birds, and tickets must now be booked online in advance.",
    "A local radio station celebrated fifty years on air with a live concert in the town square, "
    "featuring musicians who had played on the station over the decades.",
    "Researchers tested a new bicycle helmet design that folds flat for storage. In crash tests it"
    " protected riders as well as traditional helmets.",
    "The city replaced all of its street lights with LED lamps, which use less power and last "
    "longer, saving an estimated two million dollars a year.",
]
_MATH = [
    "What is {a} times {b}? Explain your steps.",
    "A box holds {a} pencils. How many pencils are in {b} boxes?",
    "What is {p}% of {n}?",
    "If a car drives {a} km per hour, how far does it go in {b} hours?",
    "Solve for y: {a}y - {b} = {c}.",
    "What is the perimeter of a rectangle that is {a} cm by {b} cm?",
    "Tom has {n} marbles and gives away {a}. How many are left?",
    "Convert {a} hours into minutes.",
    "What is the average of {a}, {b} and {c}?",
]


@dataclass(frozen=True)
class BuildPrompt:
    task: str
    prompt: str


def build_prompts(count: int, seed: int = BUILD_SEED) -> list[BuildPrompt]:
    """Up to `count` distinct prompts, taking the five task types in turn; reproducible from `seed`.

    A benchmark prompt is never one of them.

    A task whose templates run out of new combinations drops out, so it may get fewer.
    """
    from modelbuild.teacher_prompts import benchmark_prompts

    rng = random.Random(seed)
    prompts: list[BuildPrompt] = []
    seen: set[str] = set(benchmark_prompts())
    exhausted: set[str] = set()
    index = 0
    while len(prompts) < count and len(exhausted) < len(TASKS):
        task = TASKS[index % len(TASKS)]
        index += 1
        if task in exhausted:
            continue
        for _ in range(200):  # draws before deciding that a task has no new combination left
            text = _prompt(task, rng)
            if text not in seen:
                seen.add(text)
                prompts.append(BuildPrompt(task, text))
                break
        else:
            exhausted.add(task)
    return prompts


def _prompt(task: str, rng: random.Random) -> str:
    if task == "chat":
        return rng.choice(_CHAT).format(
            subject=rng.choice(_SUBJECTS), activity=rng.choice(_ACTIVITIES)
        )
    if task == "code":
        return rng.choice(_CODE).format(
            python_task=rng.choice(_PYTHON_TASKS),
            language=rng.choice(_LANGUAGES),
            snippet=rng.choice(_SNIPPETS),
            sql_task=rng.choice(_SQL_TASKS),
            concept=rng.choice(_CONCEPTS),
            shell_task=rng.choice(_SHELL_TASKS),
        )
    if task == "translate":
        return rng.choice(_TRANSLATE).format(
            language=rng.choice(_TARGET_LANGUAGES), sentence=rng.choice(_SENTENCES)
        )
    if task == "summarize":
        return rng.choice(_SUMMARIZE).format(passage=rng.choice(_PASSAGES))
    a, b, c = rng.randint(3, 60), rng.randint(2, 12), rng.randint(10, 90)
    return rng.choice(_MATH).format(
        a=a, b=b, c=c, p=rng.choice([5, 10, 20, 25, 30, 75]), n=rng.randint(2, 40) * 10
    )


def greedy_answers(
    target: Runtime,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    eos_id: int,
    batch_size: int = 16,
    progress: bool = True,
) -> list[list[int]]:
    """Greedy answers, decoded a batch at a time (for throughput; the table only counts them)."""
    import numpy as np
    from tqdm import tqdm

    answers: list[list[int]] = []
    bar = tqdm(total=len(prompts), unit="prompt", desc="target answers", disable=not progress)
    for start in range(0, len(prompts), batch_size):
        group = prompts[start : start + batch_size]
        caches = [target.new_cache() for _ in group]
        logits = target.forward_batch(list(zip(group, caches, strict=True)))
        outputs = [[int(np.argmax(rows[-1]))] for rows in logits]
        for _ in range(max_new_tokens - 1):
            live = [i for i, out in enumerate(outputs) if out[-1] != eos_id]
            if not live:
                break
            rows = target.forward_batch([([outputs[i][-1]], caches[i]) for i in live])
            for i, row in zip(live, rows, strict=True):
                outputs[i].append(int(np.argmax(row[-1])))
        answers += outputs
        bar.update(len(group))
    bar.close()
    return answers


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from inference.drafters import DEFAULT_NGRAM_TABLE

    parser.add_argument(
        "--models-dir", type=Path, default=None, help="models directory (default: from settings)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"table file (default: {DEFAULT_NGRAM_TABLE} for SmolLM2, else "
        "models dir/TARGET-4gram.ngram)",
    )
    parser.add_argument(
        "--target",
        default=None,
        help="the built target whose answers fill the table (default: SmolLM2)",
    )
    parser.add_argument(
        "--prompts", type=int, default=DEFAULT_PROMPTS,
        help="how many template prompts the target answers here (0: teacher text only)",
    )  # fmt: skip
    parser.add_argument(
        "--teacher", type=Path, default=None,
        help="also count the target's answers in this teacher file (`specfleet models distill "
        "--teacher-only` writes one: models dir/distill/teacher.jsonl)",
    )  # fmt: skip
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=DEFAULT_MAX_NEW_TOKENS,
        help=f"tokens the target answers each prompt with (default {DEFAULT_MAX_NEW_TOKENS})",
    )
    parser.add_argument("--order", type=int, default=DEFAULT_ORDER, help="n of the n-grams")
    parser.add_argument("--seed", type=int, default=BUILD_SEED, help="prompt generator seed")
    parser.add_argument("--threads", type=int, default=None, help="ONNX Runtime threads")


def run(args: argparse.Namespace) -> int:
    from core.errors import CommandError
    from inference.artifacts import ArtifactError, default_models_dir, sha256_file
    from inference.drafters import DEFAULT_NGRAM_TABLE
    from inference.proposers import NGramTable
    from inference.tokenizer import ChatTokenizer
    from modelbuild.distill import read_teacher, without_benchmark
    from modelbuild.target_build import DEFAULT_PRECISION, ensure_target, load_target
    from modelbuild.target_build import target_name as default_target_name

    if args.prompts < 0 or args.max_new_tokens < 1:
        raise CommandError("--prompts must be >= 0 and --max-new-tokens >= 1")
    if args.prompts == 0 and args.teacher is None:
        raise CommandError("--prompts 0 needs --teacher: the table would be empty")
    if args.order < 2:
        raise CommandError(f"--order must be >= 2, got {args.order}")
    started = time.perf_counter()
    sequences: list[list[int]] = []
    teacher_info: dict[str, object] = {}
    teacher_tokens = 0
    models_dir = args.models_dir or default_models_dir()
    try:
        target_dir = ensure_target(models_dir, name=args.target)
    except ArtifactError as exc:
        raise CommandError(str(exc)) from exc
    tokenizer = ChatTokenizer.load(target_dir)
    default = target_dir.name == default_target_name(DEFAULT_PRECISION)
    out: Path = args.out or (
        DEFAULT_NGRAM_TABLE if default else models_dir / f"{target_dir.name}-4gram.ngram"
    )
    if args.teacher is not None:
        if not args.teacher.is_file():
            raise CommandError(f"no teacher file at {args.teacher}")
        try:
            records = read_teacher(args.teacher)
        except (ValueError, TypeError, KeyError) as exc:
            raise CommandError(f"{args.teacher}: not a teacher file ({exc})") from exc
        records = without_benchmark(records, tokenizer)
        sequences += [r.prompt_ids + r.answer_ids for r in records]
        teacher_tokens = sum(len(r.answer_ids) for r in records)
        teacher_info = {
            "teacher_answers": len(records),
            "teacher_tokens": teacher_tokens,
            "teacher_sha256": sha256_file(args.teacher),
        }
    answer_tokens = 0
    # The teacher text is the same target's (distill --target writes it), as are the answers here.
    target_name = target_dir.name
    if args.prompts:
        target, tokenizer = load_target(models_dir, threads=args.threads, name=args.target)
        prompts = build_prompts(args.prompts, args.seed)
        prompt_ids = [tokenizer.apply_chat_template(p.prompt) for p in prompts]
        answers = greedy_answers(target, prompt_ids, args.max_new_tokens, tokenizer.eos_id)
        sequences += [p + a for p, a in zip(prompt_ids, answers, strict=True)]
        answer_tokens = sum(len(a) for a in answers)
    table = NGramTable.build(sequences, order=args.order)
    table.save(out)
    info = {
        "target": target_name,
        "vocab_sha256": tokenizer.vocab_sha256,
        "prompts": args.prompts,
        "seed": args.seed,
        "max_new_tokens": args.max_new_tokens,
        "order": args.order,
        "answer_tokens": answer_tokens,
        **teacher_info,
        "contexts": len(table.entries),
        "sha256": sha256_file(out),
    }
    out.with_suffix(".json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    print(
        f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB, {len(table.entries)} "
        f"contexts from {answer_tokens + teacher_tokens} answer tokens) in "
        f"{time.perf_counter() - started:.0f} s"
    )
    return 0
