"""Synthetic prompts over the five task types, from templates and word lists, for teacher text.

The templates can reproduce a benchmark prompt word for word; `benchmark_prompts` lists the
prompts that acceptance is measured or tuned on, and teacher text must never answer one.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

TASKS = ("chat", "code", "translate", "summarize", "math")
REPO_ROOT = Path(__file__).resolve().parents[1]
# The shared benchmark prompts (beside the repository) and the tuning prompts kept in it.
BENCHMARK_PROMPT_FILES = (
    REPO_ROOT.parent / "shared" / "bench" / "prompts.jsonl",
    REPO_ROOT / "bench" / "prompts" / "tune.jsonl",
)


def benchmark_prompts(files: tuple[Path, ...] = BENCHMARK_PROMPT_FILES) -> frozenset[str]:
    """The text of every prompt in the benchmark files that exist (JSONL with a `prompt`)."""
    texts: set[str] = set()
    for path in files:
        if path.exists():
            for line in path.read_text().splitlines():
                if line.strip():
                    texts.add(str(json.loads(line)["prompt"]))
    return frozenset(texts)


@dataclass(frozen=True)
class TeacherPrompt:
    """One generated prompt; `index` makes it reproducible from the generator's seed."""

    index: int
    task: str
    prompt: str


_TOPICS = [
    "photosynthesis",
    "black holes",
    "the water cycle",
    "inflation",
    "compound interest",
    "the immune system",
    "plate tectonics",
    "machine learning",
    "the French Revolution",
    "renewable energy",
    "the stock market",
    "climate change",
    "DNA",
    "volcanoes",
    "gravity",
    "the internet",
    "electric cars",
    "the Roman Empire",
    "coffee",
    "sleep",
    "meditation",
    "recycling",
    "the moon landing",
    "honey bees",
    "rainbows",
    "earthquakes",
    "vitamins",
    "cryptocurrency",
    "the printing press",
    "jazz music",
    "the Olympic Games",
    "tides",
    "antibiotics",
    "the human heart",
    "cloud computing",
    "solar panels",
    "democracy",
    "the Great Wall of China",
    "tea",
    "bread baking",
    "dinosaurs",
    "the ozone layer",
]
_ACTIVITIES = [
    "studying for exams",
    "saving money",
    "learning a new language",
    "running a marathon",
    "working from home",
    "cooking healthy meals",
    "staying focused",
    "making friends in a new city",
    "traveling on a budget",
    "keeping a garden",
    "writing a novel",
    "public speaking",
    "reducing stress",
    "learning to play guitar",
    "organizing a small office",
    "training a puppy",
    "getting up early",
    "moving to a new apartment",
    "preparing for a job interview",
    "drinking more water",
    "reading more books",
    "starting a podcast",
    "planning a wedding",
]
_AUDIENCES = [
    "a five-year-old",
    "a teenager",
    "a beginner",
    "a busy manager",
    "my grandmother",
    "a high school student",
    "someone new to the topic",
]
_FORMS = [
    "poem",
    "story",
    "haiku",
    "limerick",
    "product description",
    "thank-you note",
    "motivational message",
    "joke",
    "short speech",
    "birthday message",
    "diary entry",
]
_SUBJECTS = [
    "the ocean",
    "a lost cat",
    "autumn leaves",
    "a rainy Monday",
    "a robot chef",
    "friendship",
    "a mountain village",
    "the first day of school",
    "an old lighthouse",
    "a dragon who loves books",
    "the city at night",
    "a summer picnic",
    "a quiet library",
]
_THINGS = [
    "electric cars",
    "remote work",
    "social media",
    "online classes",
    "city life",
    "owning a dog",
    "renting an apartment",
    "nuclear power",
    "fast food",
    "video games",
    "public transport",
    "open-plan offices",
    "e-books",
    "freelancing",
    "solar energy",
]
_OCCASIONS = [
    "a rainy weekend",
    "a child's birthday party",
    "a team-building day",
    "a family reunion",
    "a first date",
    "a holiday dinner",
    "a school fundraiser",
    "a quiet evening at home",
    "a summer road trip",
    "a company retreat",
]
_WHY = [
    "cats purr",
    "leaves change color in autumn",
    "we dream",
    "the sea is salty",
    "birds migrate",
    "bread rises",
    "ice floats",
    "the sky is blue",
    "we get hiccups",
    "onions make us cry",
    "metal feels cold",
    "planes can fly",
    "people yawn",
    "stars twinkle",
    "the moon has phases",
    "coffee keeps us awake",
]
_PAIRS = [
    ("a cat", "a dog"),
    ("tea", "coffee"),
    ("Python", "Java"),
    ("a laptop", "a tablet"),
    ("renting", "buying a home"),
    ("running", "swimming"),
    ("weather", "climate"),
    ("a virus", "a bacterium"),
    ("stocks", "bonds"),
    ("RAM", "storage"),
    ("a lake", "a pond"),
    ("speed", "velocity"),
    ("a crocodile", "an alligator"),
]

_CHAT: list[str] = [
    "What is {topic}?",
    "Explain {topic} to {audience}.",
    "Give me {n} tips for {activity}.",
    "How can I get better at {activity}?",
    "Write a short {form} about {subject}.",
    "What are the pros and cons of {thing}?",
    "Suggest {n} ideas for {occasion}.",
    "Why do {why}?",
    "What is the difference between {a_pair} and {b_pair}?",
    "Tell me an interesting fact about {topic}.",
    "Can you help me plan {occasion}?",
    "I feel tired all the time. What could help?",
    "What should I know before {activity}?",
    "Describe {topic} in three sentences.",
    "Is {thing} a good idea? Explain briefly.",
    "What are {n} common mistakes people make when {activity}?",
    "Write a {form} for a friend who loves {topic}.",
    "How does {topic} affect everyday life?",
]

_LANGS = ["Python", "JavaScript", "Java", "C", "Go", "Rust", "TypeScript", "C++"]
_CODE_TASKS = [
    "reverses a string",
    "checks whether a number is prime",
    "returns the largest element of a list",
    "counts the vowels in a string",
    "merges two sorted lists",
    "computes the factorial of n",
    "removes duplicates from a list",
    "checks whether two strings are anagrams",
    "converts Celsius to Fahrenheit",
    "sums the digits of an integer",
    "flattens a nested list",
    "finds the second largest number in a list",
    "returns the n-th Fibonacci number",
    "counts word frequencies in a text",
    "validates an email address with a regular expression",
    "sorts a list of dictionaries by a key",
    "computes the greatest common divisor of two numbers",
    "checks whether a year is a leap year",
    "reads a file and counts its lines",
    "returns the indices of two numbers that add up to a target",
    "capitalizes every word",
    "computes the average of a list of numbers",
    "implements binary search",
    "transposes a matrix",
    "generates all subsets of a list",
    "rotates a list by k positions",
]
_CODE_CONCEPTS = [
    "a closure",
    "recursion",
    "a hash map",
    "a linked list",
    "an iterator",
    "a generator",
    "exception handling",
    "a class",
    "an interface",
    "a lambda",
    "a binary tree",
    "a decorator",
    "async and await",
    "a queue",
    "a pointer",
    "dependency injection",
    "unit testing",
    "a race condition",
    "big-O notation",
]
_SQL = [
    "counts orders per customer in a table named orders",
    "finds the top 5 products by total sales",
    "lists employees who earn more than their manager",
    "returns the average salary per department",
    "deletes duplicate rows from a table named users",
    "finds customers who placed no orders",
    "joins the tables authors and books",
    "selects all rows from events created in the last 7 days",
]
_BASH = [
    "finds all .log files larger than 10 MB",
    "counts the lines in every .py file",
    "renames all .txt files to .md",
    "shows the 10 largest files in a directory",
    "prints the disk usage of the home folder",
    "finds and deletes empty directories",
    "replaces a word in every file of a folder",
    "lists running processes sorted by memory",
]
_HOWTO = [
    "read a CSV file",
    "sort a dictionary by value",
    "make an HTTP request",
    "parse JSON",
    "write to a file",
    "measure how long a function takes",
    "remove whitespace from a string",
    "copy a list",
    "handle a missing key in a dictionary",
    "format a date",
    "generate a random number",
    "run code in parallel",
    "read user input",
]
_SNIPPETS = [
    "def add(a, b):\n    return a - b",
    "for i in range(10):\n    print(i * i)",
    "def is_even(n):\n    return n % 2 == 1",
    "numbers = [3, 1, 2]\nnumbers.sort()\nprint(numbers[0])",
    "def greet(name):\n    print('Hello, ' + name)\n\ngreet('Ana')",
    "total = 0\nfor x in [1, 2, 3]:\n    total += x\nprint(total / len([1, 2, 3]))",
    "def last(items):\n    return items[len(items)]",
    "words = text.split()\ncounts = {}\nfor w in words:\n    counts[w] = counts.get(w, 0) + 1",
    "SELECT name FROM users WHERE age > 30 ORDER BY name;",
    "x = [i for i in range(20) if i % 3 == 0]",
]
_CODE: list[str] = [
    "Write a {lang} function that {code_task}.",
    "Write a Python function that {code_task}.",
    "Explain what {code_concept} is in {lang}, with an example.",
    "Write a SQL query that {sql}.",
    "Write a bash command that {bash}.",
    "How do I {howto} in Python?",
    "What does this code do?\n\n{snippet}",
    "Find the bug in this code:\n\n{snippet}",
    "Write a Python class for {class_thing}.",
    "How do I {howto} in {lang}?",
    "Add comments to this code:\n\n{snippet}",
    "Rewrite this code to be more readable:\n\n{snippet}",
]
_CLASS_THINGS = [
    "a simple stack with push, pop and peek",
    "a bank account with deposit and withdraw",
    "a to-do list",
    "a rectangle with area and perimeter",
    "a counter that can reset",
    "a queue backed by two stacks",
    "a temperature converter",
    "a shopping cart",
]

_TARGET_LANGS = ["French", "Spanish", "German", "Italian", "Portuguese", "Dutch"]
_NAMES = [
    "Anna",
    "Ben",
    "Carla",
    "David",
    "Elena",
    "Farid",
    "Grace",
    "Hugo",
    "Ines",
    "Jonas",
    "Kira",
    "Liam",
    "Maya",
    "Noah",
    "Olga",
    "Pedro",
    "Rosa",
    "Sam",
    "Tara",
    "Victor",
]
_PLACES = [
    "the station",
    "the market",
    "the library",
    "the beach",
    "the office",
    "the park",
    "the museum",
    "the hospital",
    "the airport",
    "the school",
    "the bakery",
    "the cinema",
]
_SENTENCES = [
    "Where is {place}?",
    "I would like a cup of coffee, please.",
    "{name} is going to {place} tomorrow.",
    "The weather is beautiful today.",
    "Can you help me find {place}?",
    "My brother lives in a small house near {place}.",
    "We are meeting at {place} at {hour} o'clock.",
    "How much does this cost?",
    "I have been learning to cook for {n} years.",
    "The children are playing in the garden.",
    "Please close the window, it is cold.",
    "{name} bought {n} apples and a loaf of bread.",
    "The train to the city leaves in ten minutes.",
    "I don't understand, can you speak more slowly?",
    "Thank you very much for your help.",
    "Our teacher gave us a lot of homework this week.",
    "The museum is closed on Mondays.",
    "My favorite season is autumn because of the colors.",
    "Could you recommend a good restaurant?",
    "{name} reads a book every evening before sleeping.",
    "The meeting has been moved to Friday.",
]
_FRENCH = [
    "Où est la gare ?",
    "Je voudrais un café, s'il vous plaît.",
    "Il fait beau aujourd'hui.",
    "Nous allons au marché demain.",
    "Merci beaucoup pour votre aide.",
    "Le musée est fermé le lundi.",
    "Ma sœur habite à Paris depuis trois ans.",
]
_SPANISH = [
    "¿Dónde está la biblioteca?",
    "Me gusta mucho leer por la noche.",
    "Mañana vamos a la playa con mis amigos.",
    "La comida está muy rica.",
    "¿Cuánto cuesta este libro?",
    "Mi hermano trabaja en un hospital.",
]
_TRANSLATE: list[str] = [
    "Translate to {target}: {sentence}",
    "Translate the following sentence into {target}: {sentence}",
    'How do you say "{sentence}" in {target}?',
    "Translate into {target}:\n\n{sentence} {sentence2}",
    "Translate from French to English: {french}",
    "Translate from Spanish to English: {spanish}",
    'What does "{french}" mean in English?',
    "Translate this to {target} and {target2}: {sentence}",
]

_JOBS = [
    "engineer",
    "teacher",
    "nurse",
    "farmer",
    "designer",
    "chef",
    "researcher",
    "pilot",
    "shop owner",
    "student",
    "journalist",
    "architect",
    "doctor",
    "mechanic",
]
_CITIES = [
    "Lisbon",
    "Oslo",
    "Nairobi",
    "Toronto",
    "Osaka",
    "Lyon",
    "Austin",
    "Krakow",
    "Seville",
    "Melbourne",
    "Bergen",
    "Porto",
    "Denver",
    "Hamburg",
    "Valencia",
    "Dublin",
]
_PROJECTS = [
    "a community garden",
    "a small bakery",
    "a recycling program",
    "a coding club",
    "a bicycle repair shop",
    "a local newspaper",
    "a night school",
    "a food bank",
    "an online bookshop",
    "a solar power cooperative",
    "a music festival",
]
_PASSAGE_PARTS: list[list[str]] = [
    [
        "{name}, a {job} from {city}, started {project} in {year}.",
        "At first only {n} people joined, but the idea spread quickly.",
        "Within {m} years the project had more than {big} members.",
        "Local officials praised the effort and offered a small grant.",
        "Some neighbors complained about noise and traffic on weekends.",
        "{name} says the hardest part was finding volunteers who would stay.",
        "Today the project plans to open a second site next spring.",
    ],
    [
        "The team met on {day} to review the quarterly results.",
        "Sales rose by {n} percent, mostly thanks to the new product line.",
        "Costs also increased because of higher shipping prices.",
        "{name} proposed moving part of the production to {city}.",
        "Several members worried that the move would delay deliveries.",
        "The group agreed to collect more data before deciding.",
        "The next meeting is scheduled for the end of the month.",
    ],
    [
        "Researchers in {city} studied how {topic} affects people's daily habits.",
        "They followed {big} volunteers for {m} years.",
        "Participants who learned about {topic} changed their routines more often.",
        "The effect was strongest among people under thirty.",
        "However, the authors note that the sample was not fully representative.",
        "They call for larger studies in other countries.",
    ],
    [
        "I bought this {item} last month after reading many reviews.",
        "The setup took about {n} minutes and was mostly easy.",
        "It works well, although the battery lasts less than advertised.",
        "The design is elegant and it feels solid in the hand.",
        "Customer support answered my question within a day.",
        "For the price, I would still recommend it to most people.",
    ],
    [
        "Once upon a time, a young {job} named {name} lived in a village near {city}.",
        "Every morning {name} walked to the river to watch the boats.",
        "One day a stranger arrived with a map of a forgotten island.",
        "{name} decided to follow the map, even though everyone laughed.",
        "After {n} days at sea, the island finally appeared on the horizon.",
        "There was no treasure, but {name} found something better: a new home.",
    ],
]
_ITEMS = [
    "coffee machine",
    "pair of headphones",
    "backpack",
    "desk lamp",
    "electric kettle",
    "smartwatch",
    "bicycle helmet",
    "blender",
    "keyboard",
    "camping tent",
]
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]
_SUMMARIZE: list[str] = [
    "Summarize the following text in one sentence:\n\n{passage}",
    "Give a short summary of this paragraph:\n\n{passage}",
    "Summarize in three bullet points:\n\n{passage}",
    "What is the main idea of this text?\n\n{passage}",
    "TL;DR:\n\n{passage}",
    "Summarize this for a busy reader:\n\n{passage}",
    "Write a headline and a one-sentence summary for this text:\n\n{passage}",
]

_UNITS = [
    ("kilometers", "miles"),
    ("meters", "feet"),
    ("kilograms", "pounds"),
    ("liters", "gallons"),
    ("hours", "minutes"),
    ("days", "hours"),
    ("centimeters", "inches"),
]
_OBJECTS = ["apples", "marbles", "books", "stickers", "cookies", "pencils", "coins", "cards"]
_MATH: list[str] = [
    "What is {a} + {b}?",
    "What is {a} - {b}?",
    "Compute {a} * {c}.",
    "What is {big} divided by {c}?",
    "If a {item} costs ${price} and I buy {n}, how much do I pay in total?",
    "Solve for x: {c}x + {a} = {rhs}.",
    "What is {pct}% of {big}?",
    "A train travels {dist} km in {h} hours. What is its average speed?",
    "Convert {n} {unit} to {unit2}.",
    "{name} has {a} {objects} and gives away {b}. How many are left?",
    "Is {prime_candidate} a prime number? Explain.",
    "What is the square root of {square}?",
    "A rectangle is {c} cm wide and {n} cm long. What is its area and perimeter?",
    "What is the average of {a}, {b} and {c}?",
    "Simplify the fraction {num}/{den}.",
    "{name} saves ${c} every week. How much will {name} have after {n} weeks?",
    "What is {c} to the power of {e}?",
    "Round {decimal} to the nearest whole number.",
    "A shirt costs ${price} and is {pct}% off. What is the sale price?",
]


def _fill(template: str, rng: random.Random) -> str:
    a, b = rng.randint(10, 999), rng.randint(1, 500)
    c, n = rng.randint(2, 19), rng.randint(2, 12)
    first, second = rng.choice(_PAIRS)
    unit, unit2 = rng.choice(_UNITS)
    sentence = rng.choice(_SENTENCES)
    values = {
        "topic": rng.choice(_TOPICS),
        "audience": rng.choice(_AUDIENCES),
        "n": str(n),
        "activity": rng.choice(_ACTIVITIES),
        "form": rng.choice(_FORMS),
        "subject": rng.choice(_SUBJECTS),
        "thing": rng.choice(_THINGS),
        "occasion": rng.choice(_OCCASIONS),
        "why": rng.choice(_WHY),
        "a": str(a),
        "b": str(b),
        "lang": rng.choice(_LANGS),
        "code_task": rng.choice(_CODE_TASKS),
        "code_concept": rng.choice(_CODE_CONCEPTS),
        "sql": rng.choice(_SQL),
        "bash": rng.choice(_BASH),
        "howto": rng.choice(_HOWTO),
        "snippet": rng.choice(_SNIPPETS),
        "class_thing": rng.choice(_CLASS_THINGS),
        "target": rng.choice(_TARGET_LANGS),
        "target2": rng.choice(_TARGET_LANGS),
        "french": rng.choice(_FRENCH),
        "spanish": rng.choice(_SPANISH),
        "item": rng.choice(_ITEMS),
        "c": str(c),
        "big": str(rng.randint(100, 5000)),
        "price": str(rng.randint(2, 90)),
        "rhs": str(rng.randint(1000, 1200)),
        "pct": str(rng.choice([5, 10, 15, 20, 25, 30, 40, 50])),
        "dist": str(rng.randint(50, 900)),
        "h": str(rng.randint(1, 9)),
        "unit": unit,
        "unit2": unit2,
        "name": rng.choice(_NAMES),
        "objects": rng.choice(_OBJECTS),
        "prime_candidate": str(rng.randint(11, 199)),
        "square": str(rng.randint(2, 30) ** 2),
        "num": str(c * n),
        "den": str(c * rng.randint(n + 1, 20)),
        "e": str(rng.randint(2, 4)),
        "decimal": f"{rng.uniform(1, 100):.2f}",
        "place": rng.choice(_PLACES),
        "hour": str(rng.randint(1, 12)),
        "m": str(rng.randint(2, 6)),
        "job": rng.choice(_JOBS),
        "city": rng.choice(_CITIES),
        "project": rng.choice(_PROJECTS),
        "year": str(rng.randint(1995, 2024)),
        "day": rng.choice(_DAYS),
    }
    values["a_pair"], values["b_pair"] = first, second
    values["sentence"] = sentence.format(**values)
    values["sentence2"] = rng.choice(_SENTENCES).format(**values)
    values["passage"] = _passage(rng, values)
    return template.format(**values)


def _passage(rng: random.Random, values: dict[str, str]) -> str:
    parts = rng.choice(_PASSAGE_PARTS)
    count = rng.randint(3, len(parts))
    # Keep the narrative order but drop a few sentences, so passages differ in length and content.
    kept = sorted(rng.sample(range(len(parts)), count))
    return " ".join(parts[i].format(**values) for i in kept)


_TEMPLATES: dict[str, list[str]] = {
    "chat": _CHAT,
    "code": _CODE,
    "translate": _TRANSLATE,
    "summarize": _SUMMARIZE,
    "math": _MATH,
}


def teacher_prompt(index: int, seed: int = 0) -> TeacherPrompt:
    """The `index`-th prompt of the stream; tasks rotate so any prefix is balanced."""
    rng = random.Random(f"{seed}:{index}")
    task = TASKS[index % len(TASKS)]
    template = rng.choice(_TEMPLATES[task])
    return TeacherPrompt(index, task, _fill(template, rng))


def teacher_prompts(start: int = 0, seed: int = 0) -> Iterator[TeacherPrompt]:
    """Prompts from `start` on, without end."""
    index = start
    while True:
        yield teacher_prompt(index, seed)
        index += 1
