"""W3, input-grounded generation: four requests whose answers copy much of their prompt (the
workload where speculative decoding from the prompt's own n-grams pays), used by
``speculative_w3.py`` and, through its ``--dump-prompts`` ids, ``peers/vllm_speculative_w3.py``.

Add type hints to a Python module and reply with all of it, re-spell a text in British English,
fill a Markdown table from a list, and summarise a text; each through the chat template.
"""
from __future__ import annotations

CODE = '''import json
import os


def load_settings(path, defaults=None):
    settings = dict(defaults or {})
    if os.path.exists(path):
        with open(path) as f:
            settings.update(json.load(f))
    return settings


def merge(a, b):
    out = dict(a)
    for key, value in b.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def save_settings(path, settings):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(settings, f, indent=2, sort_keys=True)
    os.replace(tmp, path)


def count_words(text):
    counts = {}
    for word in text.lower().split():
        word = word.strip(".,;:!?")
        if word:
            counts[word] = counts.get(word, 0) + 1
    return counts


def top_words(text, n=10):
    counts = count_words(text)
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n]
'''

TEXT = ("The color of the harbor changed every evening. At dusk the fishermen gathered near the old "
        "center of town to organize their nets, and the neighbors would analyze the weather while "
        "the children practiced their favorite songs. Nobody realized how much the program of the "
        "festival had changed until the mayor apologized for the delay: the theater was being "
        "remodeled, the catalog of events was still on the printer, and the traveling musicians had "
        "canceled their trip. The organizers, however, were not discouraged. They moved the dance "
        "to the harbor, labeled every stall with a colorful sign, and by nine o'clock the whole "
        "town was humming with the flavor of grilled fish and the honor of a summer well spent.\n\n"
        "The next morning the harbor was quiet again. The neighbors cleaned the streets, the organizers "
        "counted the money they had raised for the new library, and the mayor thanked every volunteer "
        "by name in a short letter that was printed on the front page of the local paper. The "
        "musicians, who had finally arrived by the evening train, offered to play a free concert in "
        "the autumn, and the theater promised to open its remodeled hall in time for it. By noon the "
        "fishermen were back on the water, the children were back at school, and the only sign of the "
        "festival was a row of colorful signs drying in the sun beside the old center of town.")

ITEMS = ("Apples: 12 crates, from the north orchard, delivered Monday. "
         "Pears: 7 crates, from the river farm, delivered Tuesday. "
         "Plums: 4 crates, from the hill garden, delivered Wednesday. "
         "Cherries: 9 crates, from the north orchard, delivered Thursday. "
         "Peaches: 5 crates, from the river farm, delivered Friday. "
         "Apricots: 3 crates, from the hill garden, delivered Saturday. "
         "Lemons: 6 crates, from the south grove, delivered Sunday. "
         "Oranges: 11 crates, from the south grove, delivered Monday. "
         "Grapes: 8 crates, from the valley vineyard, delivered Tuesday. "
         "Figs: 2 crates, from the hill garden, delivered Wednesday. "
         "Quinces: 1 crate, from the river farm, delivered Thursday. "
         "Melons: 10 crates, from the valley vineyard, delivered Friday.")

W3_TASKS = [
    "Add Python type hints to every function in this module. Reply with the complete module and nothing else.\n\n"
    + CODE,
    "Rewrite the following text with British English spelling (colour, harbour, ...). Change nothing else and "
    "reply with the full text.\n\n" + TEXT,
    "Turn this list into a Markdown table with the columns Fruit, Crates, Source and Day.\n\n" + ITEMS,
    "Summarise the following text in three sentences, then quote its first sentence.\n\n" + TEXT,
]


def w3_prompts(loaded) -> list[list[int]]:
    return [loaded.encode_prompt([{"role": "user", "content": task}]) for task in W3_TASKS]

