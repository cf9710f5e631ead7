"""Every trainer's own words (issue 33): logs written here from the format strings the tables cite -- PaddlePaddle's
GradScaler, fastai's results table and progress bar, ultralytics' table, Megatron-LM's interval counters,
Lightning's padded bar values, Keras' TerminateOnNaN, composer's console logger, torchtune, timm, mmengine, NeMo,
detectron2 -- with values put in, never text copied from a user's log. A failing run is a failure of the right
family; the same trainer's healthy log stays quiet.
"""

from __future__ import annotations

import io

import pytest

from torchdoctor.logs.analyze import analyze_stream

BAR = "██████████"


def findings(lines: list[str]) -> dict:
    return {f.id: f for f in analyze_stream(io.BytesIO(("\n".join(lines) + "\n").encode())).findings}


def severe(lines: list[str]) -> dict[str, str]:
    return {i: f.severity for i, f in findings(lines).items() if f.severity in ("warn", "fail")}


def paddle(scale: float, spaced: bool = True) -> str:
    # python/paddle/amp/grad_scaler.py: 'Found inf or nan, current scale is: {}, decrease to: {}*{}'
    fmt = ("Found inf or nan, current scale is: {}, decrease to: {}*{}" if spaced else
           "Found inf or nan,current scale is: {},decrease to: {}*{}")
    return fmt.format(float(scale), float(scale), 0.5)


def fastai_v2_table(rows: list[tuple]) -> list[str]:
    # fastai/callback/progress.py: the header once, then a row per epoch (columns padded by its table printer)
    out = ["epoch     train_loss  valid_loss  error_rate  time    "]
    for r in rows:
        out.append(f"{r[0]:<10}{r[1]:<12}{r[2]:<12}{r[3]:<12}{r[4]:<8}")
    return out


def ultralytics(epoch: int, losses: tuple[str, str, str]) -> list[str]:
    # ultralytics/models/yolo/detect/train.py progress_string, then the bar whose description is the row
    head = ("%11s" * 7) % ("Epoch", "GPU_mem", "box_loss", "cls_loss", "dfl_loss", "Instances", "Size")
    row = ("%11s" * 2 + "%11s" * 3 + "%11s" * 2) % (f"{epoch}/100", "2.34G", *losses, "16", "640:")
    return [head, f"{row} 100%|{BAR}| 8/8 [00:02<00:00,  3.12it/s]",
            ("%22s" + "%11s" * 6) % ("Class", "Images", "Instances", "Box(P", "R", "mAP50", "mAP50-95):"),
            ("%22s" + "%11i" * 2 + "%11.3g" * 4) % ("all", 128, 929, 0.61, 0.52, 0.55, 0.37)]


def megatron(it: int, lm_loss: str, scale: float, skipped: int, nan: int) -> str:
    # megatron/training/training.py training_log
    loss = f" lm loss: {lm_loss} |" if lm_loss else ""
    return (f" iteration {it:8d}/ 1000000 | consumed samples: {it * 8:12d} | elapsed time per iteration (ms): 412.3 |"
            f" learning rate: 2.000E-04 | global batch size:     8 |{loss} loss scale: {scale:.1f} | grad norm: 1.234 |"
            f" number of skipped iterations: {skipped:3d} | number of nan iterations: {nan:3d} |")


CASES = {
    # ---------------------------------------------------------------- PaddlePaddle
    "paddle scale collapses below 1": (
        [paddle(2.0 ** (15 - k)) for k in range(20)], "fp16.loss-scale-collapse", "fail"),
    "paddle 2.1 spacing, scale at 0": (
        [paddle(0.0, spaced=False)] * 4, "fp16.loss-scale-collapse", "fail"),
    # ---------------------------------------------------------------- fastai
    "fastai v2 table, nan rows": (
        fastai_v2_table([(0, "0.523412", "0.412311", "0.123400", "00:12"), (1, "nan", "nan", "0.900000", "00:12")]),
        "loss.nonfinite", "fail"),
    "fastai v1 header with spaces": (
        ["epoch train loss valid loss accuracy_thresh f2_opt", "0 0.3412 0.2977 0.992211 0.871200",
         "1 nan nan 0.997788 0.000000"], "loss.nonfinite", "fail"),
    "fastprogress bar's smoothed loss": (
        ["71.39% [6930/9707 3:56:27<1:34:45 nan]"], "loss.nonfinite", "fail"),
    # ---------------------------------------------------------------- ultralytics
    "ultralytics table row": (
        ultralytics(1, ("1.234", "2.345", "1.111")) + ultralytics(2, ("nan", "nan", "nan")), "loss.nonfinite", "fail"),
    # ---------------------------------------------------------------- Megatron-LM
    "megatron nan iterations": (
        [megatron(10, "7.1E+00", 1.0, 0, 0), megatron(20, "", 1.0, 0, 3), megatron(30, "", 1.0, 0, 10)],
        "loss.nonfinite", "fail"),
    "megatron skipped updates at scale 1 (bf16)": (
        [megatron(i, "7.1E+00", 1.0, 10, 0) for i in range(10, 40, 10)], "grad.nonfinite", "fail"),
    # ---------------------------------------------------------------- Lightning's bar (NeMo prints through it)
    "lightning padded nan.0": (
        [f"Epoch 3: 100%|{BAR}| 50/50 [00:05<00:00,  9.51it/s, v_num=1, train_loss_step=nan.0, "
         "train_loss_epoch=nan.0]"], "loss.nonfinite", "fail"),
    "lightning postfix wrapped onto its own line": (
        [f"Epoch 3:  40%|{BAR[:4]}      | 20/50 [00:02<00:03,  9.51it/s, v_num=1,", " train_loss_step=inf.0]"],
        "loss.nonfinite", "fail"),
    "nemo reduced_train_loss": (
        [f"Epoch 0: :  12%|{BAR[:1]} | 120/1000 [01:02<07:40, reduced_train_loss=nan, global_step=119.0, "
         "consumed_samples=960.0]"], "loss.nonfinite", "fail"),
    # ---------------------------------------------------------------- Keras (any backend), composer, torchtune, timm
    "keras TerminateOnNaN": (
        ["Epoch 1/10", "  3/234 [..............................] - ETA: 33s - loss: 44.4110Batch 3: Invalid loss, "
         "terminating training"], "loss.nonfinite", "fail"),
    "composer console logger": (
        ["[batch=1/100]:", "\t Train loss/train/total: 2.5013", "[batch=2/100]:", "\t Train loss/train/total: nan"],
        "loss.nonfinite", "fail"),
    "torchtune bar and disk logger": (
        [f"1|10|Loss: nan: 100%|{BAR}| 10/10 [00:31<00:00,  3.12s/it]", "Step 10 | loss:nan lr:2e-05 "
         "tokens_per_second_per_gpu:1234.5"], "loss.nonfinite", "fail"),
    "timm train line": (
        ["Train: 0 [  50/1251 (  4%)]  Loss: nan (nan)  Time: 0.512s,  250.12/s  (0.520s,  246.15/s)  LR: 1.000e-04"],
        "loss.nonfinite", "fail"),
    "mmengine": (
        ["08/03 22:09:24 - mmengine - INFO - Epoch(train)  [1][ 500/2931]  lr: 2.0000e-02  eta: 0:39:15  time: 0.0578"
         "  data_time: 0.0017  memory: 2389  loss: nan  loss_rpn_cls: nan  loss_cls: nan"], "loss.nonfinite", "fail"),
}

HEALTHY = {
    "paddle start-up: one halving, then training": [
        paddle(32768.0), "[2022/11/08 14:54:54] ppcls INFO: [Train][Epoch 1/800][Iter: 10/366]lr: 0.05000000, "
        "loss: 12.44099, batch_cost: 0.54552s"],
    "fastai v2 table, finite": fastai_v2_table([(0, "0.523412", "0.412311", "0.123400", "00:12"),
                                                (1, "0.401211", "0.388001", "0.110100", "00:12")]),
    "ultralytics table, finite": ultralytics(1, ("1.234", "2.345", "1.111")) + ultralytics(2, ("1.1", "2.2", "1.0")),
    "megatron fp16 start-up search": [megatron(10, "", 8388608.0, 10, 0), megatron(20, "1.005E+01", 32768.0, 0, 0),
                                      megatron(30, "9.8E+00", 32768.0, 0, 0)],
    "megatron bf16, nothing skipped": [megatron(i, "7.1E+00", 1.0, 0, 0) for i in range(10, 40, 10)],
    "lightning bar, finite": [f"Epoch 3: 100%|{BAR}| 50/50 [00:05<00:00,  9.51it/s, v_num=1, train_loss_step=0.412, "
                              "train_loss_epoch=0.433]"],
    "detectron2 events": ["[11/01 20:14:15 d2.utils.events]: eta: 5:41:49  iter: 379  total_loss: 1.707  loss_cls: "
                          "1.184  loss_box_reg: 0.475  time: 0.2293  data_time: 0.0033  lr: 0.003796  max_mem: 3782M"],
    "keras on torch, finite": ["Epoch 1/3", "32/32 ━━━━━━━━━━━━━━━━━━━━ 1s 4ms/step - mean_absolute_error: 0.4083 - "
                               "loss: 0.2566"],
    "a prose line with 'loss' in it is no table": ["the loss function is cross entropy over 10 classes",
                                                   "0 1 2 3 4 5 nan 7 8"],
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_trainers_failure_in_its_own_words(name):
    lines, fid, severity = CASES[name]
    got = severe(lines)
    assert got.get(fid) == severity, (name, got)


@pytest.mark.parametrize("name", list(HEALTHY))
def test_the_same_trainers_healthy_log_stays_quiet(name):
    assert severe(HEALTHY[name]) == {}, name


def test_the_table_names_the_column_and_the_bar_its_count():
    f = findings(fastai_v2_table([(0, "0.52", "0.41", "0.12", "00:12"), (1, "nan", "0.39", "0.11", "00:12")]))
    assert "train_loss" in f["loss.nonfinite"].evidence[0]
    f = findings(ultralytics(1, ("1.2", "2.3", "1.1")) + ultralytics(2, ("1.2", "nan", "1.1")))
    assert "cls_loss" in f["loss.nonfinite"].evidence[0]  # the column whose value is nan, not the first loss
    f = findings(["71.39% [6930/9707 3:56:27<1:34:45 nan]"])["loss.nonfinite"]
    assert f.data["first_step"] == 6930 and "progress 6930/9707" in f.title


def test_paddles_collapse_is_said_with_paddles_own_fix():
    f = findings([paddle(2.0 ** (15 - k)) for k in range(20)])["fp16.loss-scale-collapse"]
    assert any("paddle.amp" in x for x in f.fix)
    assert "0.03125" in " ".join(f.evidence)  # the trajectory read from the lines: 2**15 halved 20 times


def test_megatrons_counters_are_read_as_what_they_count():
    f = findings([megatron(10, "7.1E+00", 1.0, 0, 0), megatron(20, "", 1.0, 0, 3)])["loss.nonfinite"]
    assert "3 iteration(s)" in f.evidence[0]
    g = findings([megatron(i, "7.1E+00", 1.0, 10, 0) for i in range(10, 40, 10)])["grad.nonfinite"]
    assert g.data["unscaled_overflows"] == 30  # 10 skipped updates per interval, three intervals
