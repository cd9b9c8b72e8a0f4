"""The digits example: Random SkipReduce keeps accuracy, static does not.

Trains the example's MLP on 8 simulated CPU devices at a 50% skip ratio
(k = 4), with IID and non-IID data over the ranks.
"""

import pathlib
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import train_digits  # noqa: E402

N = 8
STEPS = 100
SEED = 0


def _final_accuracies(non_iid: bool,
                      names: tuple[str, ...]) -> dict[str, float]:
    """Final test accuracy of each named variant, same init and batches."""
    data = train_digits.make_data(non_iid, N, SEED)
    variants = train_digits.variants(skip_ratio=0.5)
    return {
        name: train_digits.run_variant(
            name, variants[name], data, steps=STEPS, seed=SEED,
            eval_every=STEPS, progress=False)["final_acc"]
        for name in names
    }


@pytest.mark.slow
def test_random_skip_reduce_matches_all_reduce_on_iid_data():
    acc = _final_accuracies(False, ("all-reduce", "random"))
    assert acc["all-reduce"] > 0.9, acc
    assert acc["random"] >= acc["all-reduce"] - 0.02, acc


@pytest.mark.slow
def test_static_skip_reduce_is_biased_on_non_iid_data():
    acc = _final_accuracies(True, ("all-reduce", "random", "static"))
    assert acc["all-reduce"] > 0.9, acc
    assert acc["random"] >= acc["all-reduce"] - 0.02, acc
    # Static skipping always drops the same ranks, hence the same classes,
    # from the same weights.
    assert acc["static"] <= acc["random"] - 0.05, acc
