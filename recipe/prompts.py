"""An in-repo instruction set a 135M instruct model can answer, with a held-out split and a verifiable subset.

Prompts are built from templates and small fact tables, so the set is reproducible with no download. Six kinds:
short factual questions, explanations, lists, simple code, rewriting and arithmetic word problems. Factual and
arithmetic prompts carry a `reference` string that a correct answer contains; they form the verifiable subset.
Every prompt goes to one split by a hash of its text, so the held-out split never changes and is never trained on.
"""

import hashlib
import itertools
import random
from dataclasses import dataclass

CAPITALS = {
    "France": "Paris", "Italy": "Rome", "Spain": "Madrid", "Germany": "Berlin", "Japan": "Tokyo",
    "Canada": "Ottawa", "Egypt": "Cairo", "Kenya": "Nairobi", "Peru": "Lima", "Norway": "Oslo",
    "Greece": "Athens", "Portugal": "Lisbon", "Poland": "Warsaw", "Austria": "Vienna", "Ireland": "Dublin",
    "Sweden": "Stockholm", "Finland": "Helsinki", "Chile": "Santiago", "Cuba": "Havana", "Thailand": "Bangkok",
}  # fmt: skip
OPPOSITES = {
    "hot": "cold", "big": "small", "fast": "slow", "happy": "sad", "up": "down", "light": "dark",
    "open": "closed", "early": "late", "full": "empty", "old": "new", "hard": "soft", "wet": "dry",
    "long": "short", "loud": "quiet", "strong": "weak", "rich": "poor", "clean": "dirty", "tall": "short",
}  # fmt: skip
OPPOSITE_TEMPLATES = ["What is the opposite of '{}'?", "Give the antonym of the word '{}'."]
LEGS = {"spider": "8", "dog": "4", "bird": "2", "ant": "6", "cat": "4", "horse": "4", "chicken": "2", "beetle": "6"}
LEG_TEMPLATES = ["How many legs does a {} have?", "A {} has how many legs?"]
TOPICS = [
    "photosynthesis", "gravity", "the water cycle", "electricity", "rainbows", "volcanoes", "the moon's phases",
    "tides", "evaporation", "magnets", "sound", "seasons", "clouds", "friction", "digestion", "recycling",
    "vaccines", "earthquakes", "wind", "the internet", "money", "democracy", "a calendar", "a compass",
    "a thermometer", "the heart", "bees", "snow", "lightning", "a library", "a map", "the sun", "soil",
    "batteries", "bridges", "plants", "fossils", "deserts", "oceans", "rivers", "forests", "dinosaurs",
    "the alphabet", "a clock", "a bicycle", "exercise", "sleep", "teamwork",
]  # fmt: skip
LIST_SUBJECTS = [
    "fruits", "vegetables", "colours", "animals that live in the sea", "musical instruments", "sports",
    "countries in Europe", "planets", "kitchen tools", "things found in a classroom", "birds", "flowers",
    "ways to save water", "healthy breakfast foods", "board games", "careers in science", "winter clothes",
    "things to pack for a picnic", "programming languages", "insects", "types of weather", "shapes",
    "farm animals", "jobs in a hospital", "things that are cold", "things that fly", "hobbies", "desserts",
    "forms of transport", "parts of a tree", "things made of wood", "summer activities", "pets", "tools",
    "body parts", "famous rivers", "kinds of music", "things you can recycle", "school subjects", "drinks",
]  # fmt: skip
LIST_TEMPLATES = [
    "List three {}.", "Name four {}.", "Give me five examples of {}.", "What are two {}?", "Write a short list of {}.",
]  # fmt: skip
EXPLAIN_TEMPLATES = [
    "Explain {} in one sentence.", "What is {}?", "Describe {} to a child.", "Why is {} important?",
    "Give a short explanation of {}.", "Tell me one interesting fact about {}.",
]  # fmt: skip
CAPITAL_TEMPLATES = [
    "What is the capital of {}?",
    "Name the capital city of {}.",
    "Which city is the capital of {}?",
]
CODE_TASKS = [
    "returns the square of a number", "adds two numbers", "checks whether a number is even",
    "reverses a string", "returns the largest item in a list", "counts the vowels in a string",
    "converts Celsius to Fahrenheit", "returns the length of a list", "checks whether a string is empty",
    "returns the sum of a list of numbers", "doubles every number in a list", "returns the first item of a list",
    "multiplies two numbers", "checks whether a number is positive", "returns the smaller of two numbers",
    "joins two strings", "returns the last item of a list", "converts a string to upper case",
    "checks whether a list is empty", "returns the average of a list of numbers", "prints hello world",
    "returns the absolute value of a number", "counts the words in a sentence", "removes spaces from a string",
]  # fmt: skip
CODE_LANGUAGES = ["Python", "JavaScript", "Java"]
SENTENCES = [
    "I walk to school every day.", "The cat sleeps on the sofa.", "We eat dinner at seven.",
    "She reads a book in the park.", "They play football after class.", "He writes a letter to his friend.",
    "The sun rises in the east.", "My brother cooks pasta on Sundays.", "The children sing a song.",
    "It rains a lot in April.", "The dog runs across the garden.", "I drink tea in the morning.",
    "Our teacher explains the lesson.", "The shop opens at nine.", "You water the plants on Mondays.",
    "The baby laughs at the clown.", "We visit our grandparents in summer.", "The train leaves at noon.",
    "She paints a picture of the sea.", "The wind blows the leaves away.",
]  # fmt: skip
REWRITE_TEMPLATES = [
    "Rewrite this sentence in the past tense: {}", "Make this sentence more formal: {}",
    "Rewrite this sentence as a question: {}", "Translate this sentence into simple French: {}",
    "Rewrite this sentence in the future tense: {}", "Make this sentence negative: {}",
]  # fmt: skip
NAMES = ["Ana", "Ben", "Chloe", "David", "Emma", "Farid", "Grace", "Hugo"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "cookies", "books"]


@dataclass(frozen=True)
class Prompt:
    """One instruction; `reference` is a string a correct answer contains (verifiable prompts only)."""

    text: str
    kind: str
    reference: str | None = None


def word_problems() -> list[Prompt]:
    """Addition, subtraction and multiplication stories with their numeric answer."""
    problems = []
    for name, item, (first, second) in itertools.product(NAMES, ITEMS, [(3, 4), (5, 2), (7, 6), (9, 3), (12, 5)]):
        problems.append(
            Prompt(f"{name} buys {first} bags with {second} {item} in each. How many {item} is that?",
                   "arithmetic", str(first * second))
        )  # fmt: skip
        problems.append(
            Prompt(f"{name} has {first} {item} and gets {second} more. How many {item} does {name} have now?",
                   "arithmetic", str(first + second))
        )  # fmt: skip
        problems.append(
            Prompt(f"{name} had {first + second} {item} and gave away {second}. How many {item} are left?",
                   "arithmetic", str(first))
        )  # fmt: skip
    return problems


def build_prompts() -> list[Prompt]:
    """Every prompt of the set, in a fixed order, without duplicates."""
    prompts = [
        Prompt(template.format(country), "factual", capital)
        for (country, capital), template in itertools.product(CAPITALS.items(), CAPITAL_TEMPLATES)
    ]
    prompts += [
        Prompt(template.format(word), "factual", opposite)
        for (word, opposite), template in itertools.product(OPPOSITES.items(), OPPOSITE_TEMPLATES)
    ]
    prompts += [
        Prompt(template.format(animal), "factual", legs)
        for (animal, legs), template in itertools.product(LEGS.items(), LEG_TEMPLATES)
    ]
    prompts += [Prompt(t.format(topic), "explanation") for topic, t in itertools.product(TOPICS, EXPLAIN_TEMPLATES)]
    prompts += [Prompt(t.format(subject), "list") for subject, t in itertools.product(LIST_SUBJECTS, LIST_TEMPLATES)]
    prompts += [
        Prompt(f"Write a {language} function that {task}.", "code")
        for task, language in itertools.product(CODE_TASKS, CODE_LANGUAGES)
    ]
    prompts += [Prompt(t.format(s), "rewriting") for s, t in itertools.product(SENTENCES, REWRITE_TEMPLATES)]
    prompts += word_problems()
    unique = {prompt.text: prompt for prompt in prompts}
    return list(unique.values())


def is_held_out(prompt: Prompt, held_out_percent: int = 10) -> bool:
    """Whether the prompt belongs to the evaluation split (a stable hash of its text)."""
    digest = hashlib.sha256(prompt.text.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % 100 < held_out_percent


def split_prompts(prompts: list[Prompt], held_out_percent: int = 10) -> tuple[list[Prompt], list[Prompt]]:
    """`(train, held_out)`: disjoint, and the same for the same prompt texts on every machine."""
    held_out = [prompt for prompt in prompts if is_held_out(prompt, held_out_percent)]
    train = [prompt for prompt in prompts if not is_held_out(prompt, held_out_percent)]
    return train, held_out


def interleave_kinds(prompts: list[Prompt], seed: int = 0) -> list[Prompt]:
    """The prompts reordered so that any prefix is balanced across kinds: each kind shuffled (seeded), then one of
    each kind in turn until a kind runs out. Taking the first n trains on every kind, not only the first listed."""
    groups: dict[str, list[Prompt]] = {}
    for prompt in prompts:
        groups.setdefault(prompt.kind, []).append(prompt)
    for kind, group in groups.items():
        random.Random(f"{seed}:{kind}").shuffle(group)
    rounds = itertools.zip_longest(*groups.values())
    return [prompt for round_ in rounds for prompt in round_ if prompt is not None]
