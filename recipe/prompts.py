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
from pathlib import Path

from finetune.files import read_jsonl

CAPITALS = {
    "France": "Paris", "Italy": "Rome", "Spain": "Madrid", "Germany": "Berlin", "Japan": "Tokyo",
    "Canada": "Ottawa", "Egypt": "Cairo", "Kenya": "Nairobi", "Peru": "Lima", "Norway": "Oslo",
    "Greece": "Athens", "Portugal": "Lisbon", "Poland": "Warsaw", "Austria": "Vienna", "Ireland": "Dublin",
    "Sweden": "Stockholm", "Finland": "Helsinki", "Chile": "Santiago", "Cuba": "Havana", "Thailand": "Bangkok",
    "Russia": "Moscow", "China": "Beijing", "India": "New Delhi", "Mexico": "Mexico City", "Argentina": "Buenos Aires",
    "Belgium": "Brussels", "Denmark": "Copenhagen", "Hungary": "Budapest", "Turkey": "Ankara", "Vietnam": "Hanoi",
    "Indonesia": "Jakarta", "Iran": "Tehran", "Colombia": "Bogota", "Morocco": "Rabat", "Ghana": "Accra",
    "Nigeria": "Abuja", "Ethiopia": "Addis Ababa", "Iceland": "Reykjavik", "Scotland": "Edinburgh", "Wales": "Cardiff",
}  # fmt: skip
OPPOSITES = {
    "hot": "cold", "big": "small", "fast": "slow", "happy": "sad", "up": "down", "light": "dark",
    "open": "closed", "early": "late", "full": "empty", "old": "new", "hard": "soft", "wet": "dry",
    "long": "short", "loud": "quiet", "strong": "weak", "rich": "poor", "clean": "dirty", "tall": "short",
}  # fmt: skip
OPPOSITE_TEMPLATES = ["What is the opposite of '{}'?", "Give the antonym of the word '{}'."]
LEGS = {"spider": "8", "dog": "4", "bird": "2", "ant": "6", "cat": "4", "horse": "4", "chicken": "2", "beetle": "6"}
LEG_TEMPLATES = ["How many legs does a {} have?", "A {} has how many legs?"]
COLOURS = {
    "banana": "yellow", "grass": "green", "snow": "white", "coal": "black", "a ripe tomato": "red",
    "a carrot": "orange", "the clear daytime sky": "blue", "a lemon": "yellow", "milk": "white", "a lime": "green",
    "a strawberry": "red", "an orange": "orange", "chocolate": "brown", "a crow": "black", "a polar bear": "white",
}  # fmt: skip
COLOUR_TEMPLATES = ["What colour is {}?", "Name the usual colour of {}.", "{} is usually what colour?"]
SOUNDS = {
    "dog": "bark", "cat": "meow", "cow": "moo", "sheep": "baa", "duck": "quack", "lion": "roar", "owl": "hoot",
    "snake": "hiss", "bee": "buzz", "horse": "neigh", "pig": "oink", "frog": "croak",
}  # fmt: skip
SOUND_TEMPLATES = ["What sound does a {} make?", "Which noise is a {} known for?"]
TOPICS = [
    "photosynthesis", "gravity", "the water cycle", "electricity", "rainbows", "volcanoes", "the moon's phases",
    "tides", "evaporation", "magnets", "sound", "seasons", "clouds", "friction", "digestion", "recycling",
    "vaccines", "earthquakes", "wind", "the internet", "money", "democracy", "a calendar", "a compass",
    "a thermometer", "the heart", "bees", "snow", "lightning", "a library", "a map", "the sun", "soil",
    "batteries", "bridges", "plants", "fossils", "deserts", "oceans", "rivers", "forests", "dinosaurs",
    "the alphabet", "a clock", "a bicycle", "exercise", "sleep", "teamwork",
    "glaciers", "mountains", "stars", "planets", "the wheel", "paper", "glass", "steam engines", "airplanes",
    "submarines", "rain", "fog", "hurricanes", "coral reefs", "butterflies", "frogs", "whales", "penguins",
    "the skeleton", "muscles", "the brain", "teeth", "bread", "cheese", "honey", "music", "painting", "libraries",
    "museums", "maps", "telescopes", "microscopes", "solar panels", "wind turbines", "email", "a keyboard",
]  # fmt: skip
LIST_SUBJECTS = [
    "fruits", "vegetables", "colours", "animals that live in the sea", "musical instruments", "sports",
    "countries in Europe", "planets", "kitchen tools", "things found in a classroom", "birds", "flowers",
    "ways to save water", "healthy breakfast foods", "board games", "careers in science", "winter clothes",
    "things to pack for a picnic", "programming languages", "insects", "types of weather", "shapes",
    "farm animals", "jobs in a hospital", "things that are cold", "things that fly", "hobbies", "desserts",
    "forms of transport", "parts of a tree", "things made of wood", "summer activities", "pets", "tools",
    "body parts", "famous rivers", "kinds of music", "things you can recycle", "school subjects", "drinks",
    "vegetables that grow underground", "things in a bathroom", "ocean animals", "jungle animals", "cheeses",
    "spices", "breakfast drinks", "garden tools", "things that are round", "things that are soft", "fabrics",
    "metals", "gemstones", "trees", "nuts", "berries", "card games", "outdoor games", "kinds of boats",
    "things that use electricity", "ways to stay healthy", "ways to be kind", "reasons to read books",
    "things you see at the beach", "things you see in the sky", "rooms in a house", "parts of a car",
    "things in a toolbox", "animals that hibernate", "night animals",
]  # fmt: skip
LIST_TEMPLATES = [
    "List three {}.", "Name four {}.", "Give me five examples of {}.", "What are two {}?", "Write a short list of {}.",
    "Can you name three {}?", "Make a bulleted list of four {}.", "Tell me three {}, one per line.",
]  # fmt: skip
EXPLAIN_TEMPLATES = [
    "Explain {} in one sentence.", "What is {}?", "Describe {} to a child.", "Why is {} important?",
    "Give a short explanation of {}.", "Tell me one interesting fact about {}.",
    "How does {} work?", "Write two sentences about {}.", "What should a student know about {}?",
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
    "returns the cube of a number", "checks whether a number is odd", "returns the factorial of a number",
    "counts down from ten", "returns the maximum of three numbers", "checks whether a word is a palindrome",
    "returns a list of even numbers up to n", "converts minutes to seconds", "subtracts two numbers",
    "checks whether a number is divisible by three", "returns the middle item of a list", "repeats a string n times",
]  # fmt: skip
CODE_LANGUAGES = ["Python", "JavaScript", "Java", "C"]
SENTENCES = [
    "I walk to school every day.", "The cat sleeps on the sofa.", "We eat dinner at seven.",
    "She reads a book in the park.", "They play football after class.", "He writes a letter to his friend.",
    "The sun rises in the east.", "My brother cooks pasta on Sundays.", "The children sing a song.",
    "It rains a lot in April.", "The dog runs across the garden.", "I drink tea in the morning.",
    "Our teacher explains the lesson.", "The shop opens at nine.", "You water the plants on Mondays.",
    "The baby laughs at the clown.", "We visit our grandparents in summer.", "The train leaves at noon.",
    "She paints a picture of the sea.", "The wind blows the leaves away.",
    "The bus stops near my house.", "He fixes old bicycles.", "We plant flowers in spring.",
    "The bakery sells fresh bread.", "My sister plays the piano.", "The birds build a nest.",
    "I clean my room on Saturdays.", "The river flows to the sea.", "They watch a film at night.",
    "The farmer feeds the cows.", "Our class visits the museum.", "The moon shines over the lake.",
    "She answers the phone.", "The boys climb the hill.", "I finish my homework after dinner.",
    "The chef tastes the soup.", "The kids build a sandcastle.", "He takes the train to work.",
    "The plants need water.", "We pack our bags for the trip.",
]  # fmt: skip
REWRITE_TEMPLATES = [
    "Rewrite this sentence in the past tense: {}", "Make this sentence more formal: {}",
    "Rewrite this sentence as a question: {}", "Translate this sentence into simple French: {}",
    "Rewrite this sentence in the future tense: {}", "Make this sentence negative: {}",
    "Rewrite this sentence with 'we' as the subject: {}", "Shorten this sentence if you can: {}",
]  # fmt: skip
NAMES = ["Ana", "Ben", "Chloe", "David", "Emma", "Farid", "Grace", "Hugo"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "cookies", "books"]
NUMBER_PAIRS = [(3, 4), (5, 2), (7, 6), (9, 3), (12, 5), (4, 8), (6, 3), (8, 7)]  # the first five: the original set


@dataclass(frozen=True)
class Prompt:
    """One instruction; `reference` is a string a correct answer contains (verifiable prompts only)."""

    text: str
    kind: str
    reference: str | None = None


# The second evaluation set: everyday prompts written by hand, unlike these templates, never trained on
EVERYDAY_FILE = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "everyday_prompts.jsonl"
PROMPT_SETS = ("held_out", "everyday")  # what the benchmarks evaluate on (`recipe.evaluate.benchmark_prompts`)


def everyday_prompts() -> list[Prompt]:
    """The everyday prompts (benchmarks/data/README.md), in the file's order: their kinds take turns."""
    return [Prompt(row["text"], row["kind"]) for row in read_jsonl(EVERYDAY_FILE, required=("kind", "text"))]


def word_problems() -> list[Prompt]:
    """Addition, subtraction and multiplication stories with their numeric answer."""
    problems = []
    for name, item, (first, second) in itertools.product(NAMES, ITEMS, NUMBER_PAIRS):
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
    prompts += [
        Prompt(template.format(thing)[0].upper() + template.format(thing)[1:], "factual", colour)
        for (thing, colour), template in itertools.product(COLOURS.items(), COLOUR_TEMPLATES)
    ]
    prompts += [
        Prompt(template.format(animal), "factual", sound)
        for (animal, sound), template in itertools.product(SOUNDS.items(), SOUND_TEMPLATES)
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
