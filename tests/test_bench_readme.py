"""`make bench-readme`'s pure parts: ratios within a round, the targets, and the Speed table
it writes into README.md between the markers."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import readme, suite


def job(rate, cut=None):
    chose = {"schedule": "1F1B", "step_graph": False, "balance": "flops"} if cut else None
    return {"median_images_per_s": rate, "stage_calls": cut, "microbatches": 4 if cut else None,
            "chose": chose}


FAILED = {"error": "exit status 1, no result line:\nboom"}
ARMS = {a["name"]: a for a in readme.ARMS}


def test_a_ratio_is_taken_within_its_round_and_a_failed_round_is_left_out():
    arms = [ARMS["one process"], ARMS["hf 1x2"]]
    rounds = {"one process": [job(100.0), job(50.0), job(100.0)],
              "hf 1x2": [job(180.0), job(95.0), FAILED]}
    got = readme.ratios(arms, rounds)["hf 1x2"]
    # round 2's slow machine shows in both: its ratio is 1.9, not 95 / median(100, 50, 100)
    assert got["rounds"] == [1.8, 1.9, None]
    assert got["median"] == 1.85


def test_a_peer_is_measured_over_its_own_single_process():
    arms = [ARMS["torch 1 process"], ARMS["torch 1f1b m=4"], ARMS["one process"]]
    rounds = {"torch 1 process": [job(50.0)], "torch 1f1b m=4": [job(70.0)],
              "one process": [job(100.0)]}
    assert readme.ratios(arms, rounds)["torch 1f1b m=4"]["rounds"] == [1.4]


def test_targets_compare_the_defaults_with_the_best_pipeline_and_torch():
    # the defaults of a training job's call (a CIFAR epoch planned), not of 10-step calls
    speedups = {"hf 1x2": {"median": 1.8}, "hf 2x1 defaults": {"median": 1.0},
                "hf 2x1 defaults long": {"median": 1.3},
                "hf 2x1 zb-h1 m=4": {"median": 1.5}, "hf 2x1 zb-h1 m=8": {"median": 1.4},
                "torch 1f1b m=4": {"median": 1.2}, "torch interleaved m=4": {"median": 1.25}}
    got = {what.split(" (")[0]: (round(value, 3), met)
           for what, value, _, met in readme.targets(speedups)}
    assert got == {"defaults": (0.867, False),
                   "the best hf pipeline": (1.5, False),
                   "the best hf pipeline ÷ PyTorch's best": (1.2, True),
                   "data parallel R = 2 over one process": (1.8, False)}


def test_the_long_defaults_arm_plans_a_cifar_epoch_and_gives_no_speed_arguments():
    args = readme.parse_args([])
    arm = next(a for a in readme.ARMS if a["name"] == "hf 2x1 defaults long")
    command = suite.command(arm, args)
    assert command[command.index("--planned-steps") + 1] == "782"
    assert "--defaults" in command and "--schedule" not in command and "--balance" not in command
    short = suite.command(next(a for a in readme.ARMS if a["name"] == "hf 2x1 defaults"), args)
    assert "--planned-steps" not in short


def report(rounds):
    names = set(rounds)
    arms = [a for a in readme.ARMS if a["name"] in names]
    return {"settings": {"depth": 110, "batch_size": 64, "rounds": len(rounds["one process"])},
            "machine": {"cpu": "Intel(R) Xeon(R) Processor", "usable_cores": 2},
            "started": "2026-11-28T11:00:00+00:00", "commit": "0123456789abcdef",
            "arms": arms, "rounds": rounds, "speedups": readme.ratios(arms, rounds),
            "peers_missing": {"horovod": "not installed"}}


def test_the_table_shows_every_round_the_median_and_what_the_defaults_chose():
    table = readme.speed_table(report({
        "one process": [job(100.0), job(100.0)],
        "hf 2x1 defaults": [job(130.0, [191, 196]), job(125.0, [191, 196])],
        "hf 2x1 zb-h1 m=4": [job(150.0, [125, 262]), FAILED]}))
    lines = table.splitlines()
    assert lines[0].startswith(readme.START) and lines[-1] == readme.END
    assert "commit 0123456789, 2026-11-28, on Intel(R) Xeon(R) Processor (2 cores)" in table
    defaults = next(line for line in lines if "no speed arguments" in line)
    # the cut's | escaped, or the cell would split the row
    assert "(1F1B on the executor, m = 4, cut 191\\|196 by 'flops')" in defaults
    assert defaults.endswith("| 1.30, 1.25 | **1.27** |")
    zb = next(line for line in lines if "zb-h1" in line)
    assert zb.endswith("(cut 125\\|262) | 1.50, failed | **1.50** |")
    assert "Not measured in this run: horovod (not installed)." in table


def test_the_record_shows_every_timed_call_of_every_job():
    # a call's time beside its steps' shows what the median of a job's calls hides (a
    # baseline whose call spends seconds outside its steps lifts that round's ratios)
    slow = dict(job(40.6), seconds=[13.1, 20.5], step_s=1.27, first_step_s=30.1)
    rep = report({"one process": [slow, FAILED], "hf 1x2": [job(90.0), job(91.0)]})
    rep.update(command="make bench-readme", minutes=60.0, targets=[])
    lines = readme.markdown(rep).splitlines()
    assert "| one process | 1 | 40.6 | 13.10, 20.50 | 30.1 | 1.270 | — | — |" in lines
    assert "| one process | 2 | failed: exit status 1, no result line: | | | | | |" in lines
    assert "| hf 1x2 | 1 | 90.0 | — | — | — | — | — |" in lines


def test_the_table_replaces_only_the_block_between_the_markers(tmp_path):
    path = tmp_path / "README.md"
    path.write_text(f"# x\n\n{readme.START}: old -->\nold table\n{readme.END}\n\nafter\n")
    assert readme.rewrite_readme(f"{readme.START} -->\nnew\n{readme.END}", str(path))
    assert path.read_text() == f"# x\n\n{readme.START} -->\nnew\n{readme.END}\n\nafter\n"
    path.write_text("no markers\n")
    assert not readme.rewrite_readme("new", str(path))
    assert path.read_text() == "no markers\n"


def test_the_readme_has_one_block_for_make_bench_readme_to_rewrite():
    with open(readme.README) as f:
        text = f.read()
    assert text.count(readme.START) == 1 and text.count(readme.END) == 1
    assert text.index(readme.START) < text.index(readme.END)
