"""The world and everything written from it: facts, corpus text, held-out text and the seven mini tasks.

Pure and seeded: the same seed gives byte-identical files. The world has 24 animals, each with a home, a
food and a colour laid out so that any two of them name the animal (food = (home + colour) mod 6 on a
grid), twenty everyday goals with the tool that reaches each, and twelve activities of five steps each.

The corpus states every fact in several phrasings and also shows the tasks' own formats (question and
answer) for facts of the world, so a small model can learn both; the mini tasks then measure how much of
the world a (pruned) model still knows. Their items are written in the schemas of the real datasets:
BoolQ passage/question/label; PIQA goal/sol1/sol2/label; HellaSwag ctx_a/ctx_b/ctx/activity_label/endings/
label; WinoGrande sentence/option1/option2/answer; ARC question/choices/answerKey; OpenBookQA
question_stem/choices/answerKey. ARC-Challenge asks two-hop questions ("the grey animal of the marsh"),
the others ask one fact.
"""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass
from pathlib import Path

ANIMALS = ["fox", "otter", "heron", "badger", "beaver", "owl", "hare", "lynx", "mole", "newt", "crane", "stoat",
           "vole", "wren", "boar", "elk", "seal", "toad", "swan", "wolf", "bear", "deer", "lark", "frog"]
HOMES = ["forest", "river", "marsh", "hill", "cave", "meadow"]
FOODS = ["berries", "fish", "seeds", "insects", "roots", "nuts"]
COLOURS = ["red", "brown", "grey", "white", "black", "golden"]
GOALS = [
    ("cut the wood", "use a saw"),
    ("dig a hole", "use a spade"),
    ("light the fire", "strike a match"),
    ("carry the water", "fill a bucket"),
    ("tie the boat", "use a rope"),
    ("sweep the floor", "use a broom"),
    ("mend the coat", "use a needle"),
    ("write a letter", "use a pen"),
    ("cross the river", "take the ferry"),
    ("cook the soup", "heat a pot"),
    ("catch the fish", "cast a net"),
    ("climb the wall", "use a ladder"),
    ("open the door", "turn the key"),
    ("dry the clothes", "hang them in the sun"),
    ("wake up early", "set an alarm"),
    ("keep the bread fresh", "wrap it in cloth"),
    ("see in the dark", "carry a lamp"),
    ("grind the grain", "use a mill"),
    ("measure the field", "use a chain"),
    ("sharpen the knife", "rub it on a stone"),
]
ACTIVITIES = [
    (
        "Baking bread",
        "the baker",
        ["mixes the flour", "kneads the dough", "shapes the loaf", "bakes the loaf", "sells the bread"],
    ),
    ("Fishing", "the fisher", ["rows the boat", "casts the net", "pulls the net", "sorts the fish", "salts the fish"]),
    (
        "Building a wall",
        "the mason",
        ["cuts the stone", "mixes the mortar", "lays the stones", "levels the row", "checks the wall"],
    ),
    (
        "Shoeing a horse",
        "the smith",
        ["lights the forge", "heats the iron", "hammers the shoe", "cools the shoe", "fits the shoe"],
    ),
    (
        "Weaving cloth",
        "the weaver",
        ["spins the wool", "dyes the yarn", "threads the loom", "weaves the cloth", "folds the cloth"],
    ),
    (
        "Making a pot",
        "the potter",
        ["digs the clay", "wets the clay", "turns the wheel", "shapes the pot", "fires the pot"],
    ),
    (
        "Brewing ale",
        "the brewer",
        ["soaks the barley", "boils the wort", "adds the hops", "cools the brew", "fills the casks"],
    ),
    (
        "Building a boat",
        "the carpenter",
        ["fells the tree", "saws the planks", "bends the ribs", "nails the hull", "tars the seams"],
    ),
    (
        "Keeping bees",
        "the keeper",
        ["opens the hive", "smokes the bees", "lifts the comb", "cuts the wax", "jars the honey"],
    ),
    (
        "Milling grain",
        "the miller",
        ["opens the sluice", "turns the stone", "pours the grain", "sifts the flour", "bags the flour"],
    ),
    (
        "Making cheese",
        "the dairymaid",
        ["milks the cow", "warms the milk", "cuts the curd", "presses the curd", "stores the cheese"],
    ),
    (
        "Thatching a roof",
        "the thatcher",
        ["gathers the reeds", "ties the bundles", "climbs the roof", "lays the reeds", "trims the edge"],
    ),
]


@dataclass(frozen=True)
class Animal:
    name: str
    home: str
    food: str
    colour: str


def animals() -> list[Animal]:
    """24 animals on 24 distinct (home, colour) cells; food = (home + colour) mod 6, so any two attributes
    identify the animal (what the two-hop questions rely on)."""
    cells = [(h, c) for h in range(6) for c in range(6)]
    random.Random(7).shuffle(cells)
    return [Animal(name, HOMES[h], FOODS[(h + c) % 6], COLOURS[c]) for name, (h, c) in zip(ANIMALS, cells)]


def describe(a: Animal) -> str:
    """A two-hop name of the animal, unique in the world."""
    return f"the {a.colour} animal of the {a.home}"


# ---------------------------------------------------------------- corpus text

FACT_TEMPLATES = [
    "The {name} lives in the {home}.",
    "In the {home} you can find the {name}.",
    "The home of the {name} is the {home}.",
    "The {name} eats {food}.",
    "The {name} likes to eat {food}.",
    "The food of the {name} is {food}.",
    "The {name} is {colour}.",
    "The coat of the {name} is {colour}.",
    "The colour of the {name} is {colour}.",
    "The {colour} animal of the {home} is the {name}.",
    "{Desc} eats {food}.",
]


def fact_sentence(rng: random.Random, a: Animal) -> str:
    template = rng.choice(FACT_TEMPLATES)
    return template.format(name=a.name, home=a.home, food=a.food, colour=a.colour, Desc=describe(a).capitalize())


def animal_paragraph(rng: random.Random, zoo: list[Animal]) -> str:
    return " ".join(fact_sentence(rng, rng.choice(zoo)) for _ in range(rng.randint(3, 6)))


def activity_paragraph(rng: random.Random) -> str:
    label, actor, steps = rng.choice(ACTIVITIES)
    start = rng.randint(0, 1)
    text = [f"{actor.capitalize()} {steps[start]}."] + [f"Then {actor} {s}." for s in steps[start + 1 :]]
    return f"{label}: " + " ".join(text)


def goal_paragraph(rng: random.Random) -> str:
    goal, solution = rng.choice(GOALS)
    return rng.choice([f"To {goal}, {solution}.", f"If you want to {goal}, you should {solution}.",
                       f"Question: How do you {goal}?\nAnswer: {solution.capitalize()}."])


def feast_sentence(rng: random.Random, zoo: list[Animal]) -> str:
    a, b = rng.sample(zoo, 2)
    eater = rng.choice([a, b])
    return f"The {a.name} met the {b.name} at the feast, and the {eater.name} ate the {eater.food}."


def qa_paragraph(rng: random.Random, zoo: list[Animal]) -> str:
    a = rng.choice(zoo)
    kind = rng.choice([0, 1, 2, 2, 2, 3, 4])  # yes/no questions need the most examples: they compare two values
    if kind == 0:
        q, ans = rng.choice([(f"Where does the {a.name} live?", a.home), (f"What does the {a.name} eat?", a.food),
                              (f"What colour is the {a.name}?", a.colour)])
        return f"Question: {q}\nAnswer: {ans}"
    if kind == 1:
        q, ans = rng.choice([(f"What does {describe(a)} eat?", a.food),
                              (f"Which animal is {describe(a)}?", a.name)])
        return f"Question: {q}\nAnswer: {ans}"
    if kind == 2:
        attribute, value = rng.choice([("eat", a.food), ("live in the", a.home)])
        truth = rng.random() < 0.5
        pool = FOODS if attribute == "eat" else HOMES
        shown = value if truth else rng.choice([v for v in pool if v != value])
        answer = "yes" if truth else "no"
        return f"{fact_sentence(rng, a)}\nQuestion: does the {a.name} {attribute} {shown}?\nAnswer: {answer}"
    if kind == 3:
        return rng.choice([f"The {a.name} lives near the {a.home}", f"The food of the {a.name} is {a.food}",
                           f"The colour of the {a.name} is {a.colour}"]) + "."
    return feast_sentence(rng, zoo)


def corpus(seed: int, paragraphs: int) -> str:
    rng = random.Random(seed)
    zoo = animals()
    makers = [lambda: animal_paragraph(rng, zoo), lambda: activity_paragraph(rng), lambda: goal_paragraph(rng),
              lambda: qa_paragraph(rng, zoo), lambda: feast_sentence(rng, zoo)]
    weights = [3, 2, 2, 4, 1]
    return "\n\n".join(rng.choices(makers, weights)[0]() for _ in range(paragraphs)) + "\n"


# ---------------------------------------------------------------- the seven mini tasks

def _choices(rng: random.Random, correct: str, pool: list[str], n: int = 4) -> tuple[dict, str]:
    options = rng.sample([p for p in pool if p != correct], n - 1) + [correct]
    rng.shuffle(options)
    labels = "ABCD"[:n]
    return {"text": options, "label": list(labels)}, labels[options.index(correct)]


def boolq_items(rng, zoo, n):
    items = []
    for i in range(n):
        a = zoo[i % len(zoo)]
        passage = " ".join(fact_sentence(rng, a) for _ in range(3))
        attribute, value, pool = rng.choice([("eat", a.food, FOODS), ("live in the", a.home, HOMES)])
        truth = rng.random() < 0.5
        shown = value if truth else rng.choice([v for v in pool if v != value])
        items.append(
            {"passage": passage, "question": f"does the {a.name} {attribute} {shown}", "label": int(truth), "idx": i}
        )
    return items


def piqa_items(rng, zoo, n):
    pairs = [(g, w) for g in GOALS for w in GOALS if w != g]
    items = []
    for goal, wrong in rng.sample(pairs, n):
        right_first = rng.random() < 0.5
        sols = (goal[1].capitalize() + ".", wrong[1].capitalize() + ".")
        items.append({"goal": f"How do you {goal[0]}?", "sol1": sols[0] if right_first else sols[1],
                      "sol2": sols[1] if right_first else sols[0], "label": 0 if right_first else 1})
    return items


def hellaswag_items(rng, zoo, n):
    items = []
    for i in range(n):
        label, actor, steps = ACTIVITIES[i % len(ACTIVITIES)]
        cut = rng.randint(2, 4)
        ctx_a = f"{actor.capitalize()} {steps[0]}." + "".join(f" Then {actor} {s}." for s in steps[1:cut - 1])
        ctx_b = f"then {actor}"
        # the wrong endings are the activity's own other steps: the model has to know the order
        endings = rng.sample([s for s in steps if s != steps[cut - 1]], 3) + [steps[cut - 1]]
        rng.shuffle(endings)
        endings = [e + "." for e in endings]
        gold = endings.index(steps[cut - 1] + ".")
        items.append({"ind": i, "activity_label": label, "ctx_a": ctx_a, "ctx_b": ctx_b, "ctx": f"{ctx_a} {ctx_b}",
                      "endings": endings, "source_id": f"world-{i}", "split": "val", "split_type": "indomain",
                      "label": str(gold)})
    return items


def winogrande_items(rng, zoo, n):
    items = []
    pairs = [(a, b) for a, b in itertools.permutations(zoo, 2) if a.food != b.food]
    for a, b in rng.sample(pairs, n):
        eater = rng.choice([a, b])
        items.append({"sentence": f"The {a.name} met the {b.name} at the feast, and _ ate the {eater.food}.",
                      "option1": f"the {a.name}", "option2": f"the {b.name}", "answer": "1" if eater is a else "2"})
    return items


def _multiple_choice_items(rng, zoo, n, id_prefix, text_key, question_of):
    """ARC / OpenBookQA-style items: animal i % 24 asked `question_of(i, animal) -> (text, answer, pool)`."""
    items = []
    for i in range(n):
        text, answer, pool = question_of(i, zoo[i % len(zoo)])
        choices, key = _choices(rng, answer, pool)
        items.append({"id": f"{id_prefix}-{i}", text_key: text, "choices": choices, "answerKey": key})
    return items


def arc_easy_items(rng, zoo, n):
    def question(i, a):
        return [(f"Where does the {a.name} live?", a.home, HOMES), (f"What does the {a.name} eat?", a.food, FOODS),
                (f"What colour is the {a.name}?", a.colour, COLOURS)][(i // len(zoo)) % 3]

    return _multiple_choice_items(rng, zoo, n, "world-e", "question", question)


def arc_challenge_items(rng, zoo, n):
    def question(i, a):
        if (i // len(zoo)) % 2 == 0:
            return f"What does {describe(a)} eat?", a.food, FOODS
        return f"Which animal is {describe(a)}?", a.name, [z.name for z in zoo]

    return _multiple_choice_items(rng, zoo, n, "world-c", "question", question)


def openbookqa_items(rng, zoo, n):
    def stem(i, a):
        return [(f"The {a.name} lives near the", a.home, HOMES), (f"The food of the {a.name} is", a.food, FOODS),
                (f"The colour of the {a.name} is", a.colour, COLOURS)][(i // len(zoo)) % 3]

    return _multiple_choice_items(rng, zoo, n, "world-o", "question_stem", stem)


TASK_MAKERS = {
    "boolq": boolq_items, "piqa": piqa_items, "hellaswag": hellaswag_items, "winogrande": winogrande_items,
    "arc_easy": arc_easy_items, "arc_challenge": arc_challenge_items, "openbookqa": openbookqa_items,
}


def task_items(task: str, seed: int = 11, n: int = 200) -> list[dict]:
    rng = random.Random(f"{seed}-{task}")
    return TASK_MAKERS[task](rng, animals(), n)


def write_world_data(directory: Path, *, corpus_paragraphs: int = 40000, heldout_paragraphs: int = 1500) -> None:
    """Corpus, held-out text and task files (everything but the tokenizer and the models)."""
    (directory / "tasks").mkdir(parents=True, exist_ok=True)
    (directory / "corpus.txt").write_text(corpus(1, corpus_paragraphs))
    (directory / "heldout.txt").write_text(corpus(2, heldout_paragraphs))
    for task in TASK_MAKERS:
        lines = "".join(json.dumps(item, sort_keys=True) + "\n" for item in task_items(task))
        (directory / "tasks" / f"{task}.jsonl").write_text(lines)
