"""A verifiers (0.1.x) environment package as ``prime env install`` would provide one:
``verifiers.load_environment("local/vf-word-sort")`` imports this module and calls
``load_environment``. Single turn: sort three words; the rubric checks the answer."""

import verifiers as vf
from datasets import Dataset

ROWS = [
    {"question": "pear apple fig", "answer": "apple fig pear"},
    {"question": "kiwi banana cherry", "answer": "banana cherry kiwi"},
    {"question": "plum date lime", "answer": "date lime plum"},
]


def load_environment(**kwargs):
    def sorted_words(completion, answer, **_):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        return 1.0 if answer in text else 0.0

    def short(completion, **_):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        return 1.0 if len(text) < 40 else 0.0

    rubric = vf.Rubric(funcs=[sorted_words, short], weights=[1.0, 0.0])
    return vf.SingleTurnEnv(
        dataset=Dataset.from_list(ROWS),
        system_prompt="Sort the user's words alphabetically.",
        rubric=rubric,
        **kwargs,
    )
