"""Regenerate taylor_tune/data/sample_corpus.txt: a small deterministic English-like corpus.

Templated paragraphs about a made-up region (towns, rivers, trades, seasons). It only has to be real-looking
text for calibration in demos and tests; it is not meant to teach a model anything.
Usage: python scripts/make_sample_corpus.py
"""

import random
from pathlib import Path

TOWNS = ["Alder", "Brisk", "Corvel", "Dunmere", "Ellow", "Fennick", "Garrow", "Holt", "Isel", "Jarrow"]
RIVERS = ["the Ash", "the Bourne", "the Calder", "the Dee", "the Esk"]
TRADES = ["weavers", "millers", "smiths", "potters", "fishers", "masons", "brewers", "carpenters"]
GOODS = ["wool", "grain", "iron", "clay", "salt", "timber", "honey", "cloth"]
SEASONS = ["spring", "summer", "autumn", "winter"]
SENTENCES = [
    "{town} lies on the bank of {river}, where the {trade} sell {good} to travellers.",
    "In {season} the road from {town} to {town2} is often closed by floods from {river}.",
    "Most families in {town} are {trade}, and their {good} is known across the valley.",
    "The market of {town2} opens every week, and the {trade} of {town} bring {good} there.",
    "When {season} comes, the people of {town} repair the bridge over {river}.",
    "A council of {trade} governs {town}, and it meets in the old hall near {river}.",
    "Travellers say that the {good} of {town2} is better than the {good2} of {town}.",
    "The school in {town} teaches children to count {good} and to read the river charts of {river}.",
]


def paragraph(rng: random.Random) -> str:
    lines = []
    for _ in range(rng.randint(3, 7)):
        town, town2 = rng.sample(TOWNS, 2)
        good, good2 = rng.sample(GOODS, 2)
        lines.append(rng.choice(SENTENCES).format(
            town=town, town2=town2, river=rng.choice(RIVERS), trade=rng.choice(TRADES),
            good=good, good2=good2, season=rng.choice(SEASONS),
        ))
    return " ".join(lines)


def main() -> None:
    rng = random.Random(20261121)
    text = "\n\n".join(paragraph(rng) for _ in range(600)) + "\n"
    out = Path(__file__).resolve().parent.parent / "taylor_tune" / "data" / "sample_corpus.txt"
    out.write_text(text)
    print(f"wrote {out} ({len(text)} characters)")


if __name__ == "__main__":
    main()
