"""The log lines ``torchdoctor logs`` recognises on the analyzer itself, copied from the code that prints them.
(Communication, builds, host memory and GPU support are families of their own, each with its table and sources:
:mod:`.families`; every trainer's loss scaler and the non-finite sentences are :mod:`.scalers` and
:mod:`.nonfinite`.)

Sources (wording checked against the installed packages where they ship it):
  - DeepSpeed 0.19.8 ``runtime/fp16/loss_scaler.py`` (``[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss
    scale: 65536, reducing to 32768``, the hysteresis variant, ``Current loss scale already at minimum - cannot
    decrease scale anymore. Exiting run.``), ``fused_optimizer.py`` / ``unfused_optimizer.py`` (``Grad overflow on
    iteration N``, ``Reducing dynamic loss scale from X to Y``), ``engine.py`` (``step=N, skipped=S, lr=...``),
    ``launcher/launch.py`` (``... exits with return code = -9``), ``runtime/config.py`` (batch-size and fp16+bf16
    assertions), legacy ``[deepscale] OVERFLOW!`` and ``Overflow detected.`` lines (older releases, still in logs);
  - torch ``distributed/elastic`` (``exitcode  : -9 (pid: 123)``, ``Signal 9 (SIGKILL) received by PID 123``,
    ``failed (exitcode: -9) local_rank: 0 (pid: 123)``), the caching allocator (``CUDA out of memory. Tried to
    allocate ...``), c10's CUDA checks (``CUDA error: ...``; THC's ``THCudaCheck FAIL ... error=N : ...`` and ``cuda
    runtime error (N) : ...`` in torch <= 1.10), cuBLAS/cuDNN statuses;
  - Megatron-DeepSpeed ``training.py`` (``iteration 5426/ 250000 | ... | loss scale: 1.0 | grad norm: nan | ...``),
    custom trainers that print a GradScaler's scale (``Loss nan ... Fp16 Grad Scale: 0``);
  - transformers' Trainer log dicts (``{'loss': 'nan', 'grad_norm': 'inf', ...}``: 5.x formats floats as strings,
    4.x printed raw floats), tqdm postfixes (``loss=nan``), bash/zsh/dmesg/slurm kill and OOM-killer lines.

Speed: a log is scanned in large chunks with a few C-speed searches (the scanner's ``SCAN_RE`` over every table's
anchors, ``EXIT_SCAN_RE``, ``ERROR_SCAN_RE``, ``LOSS_SCAN_RE``, ``NORM_SCAN_RE``, ``NEEDLES``) whose anchors start
with characters that are rare in logs, so Python code runs only on the few lines that can matter; each of those is
then matched against the rules whose key it holds (one search finds them: ``scan._key_index``).
"""

from __future__ import annotations

import re

NUM = r"[-+]?\d+(?:\.\d*)?(?:[eE][+-]?\d+)?"
_SIZE = r"\d+(?:\.\d+)?\s?[KMGTP]?i?B"

#: ANSI escape sequences (colours, cursor moves) -- stripped from a candidate line before matching.
ANSI_RE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")
#: DeepSpeed's logging prefix ``[2026-03-02 10:00:00,123] [INFO] [engine.py:3793:_report_progress] ``.
DS_PREFIX_RE = re.compile(
    r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\] \[(DEBUG|INFO|WARNING|ERROR|CRITICAL)\] \[([\w.]+):(\d+):(\w+)\] ")

# --- the pre-filter -------------------------------------------------------------------------------------------
# Every alternative is a plain literal (a group or a class in front makes `re` try every position), and most
# start with a character that is rare in training logs (upper case, v, x, j, _): `re` then skips ahead with
# its first-character set. A line with none of these (or of LOSS/NORM_SCAN_RE, NEEDLES) produces no event.
SCAN_ANCHORS = (
    # DeepSpeed fp16 loss scaling
    "OVERFLOW", "verflow", "Reducing dynamic", "Increasing dynamic", "Using static loss", "Current loss scale",
    "Exception: ", "Grad Scale:", "╰─> [",
    # memory
    "CUDA out of memory", "OutOfMemoryError", "Out of memory", "Killed", "killed  ", "OOM",
    "CPU Virtual Memory", "Max_MA",
    # process exits (the "exitcode" family is EXIT_SCAN_RE)
    "SIG", "CANCELLED",
    # DeepSpeed config assertions
    "_batch_size is not equal",
    # crashes: Python tracebacks, faulthandler, shells' signal messages, CUDA runtime errors, the driver
    "Traceback (most recent", "Fatal Python error", "Segmentation fault", "Bus error", "Illegal instruction",
    "Floating point exception", "Aborted", "CUDA error", "CUDA driver version", "NVIDIA driver", "NVRM: Xid",
    "ECC error", "Assertion `", "CUDA capability", "THCudaCheck", "CUBLAS", "CUDNN",
    # errors in words no rule knows (handlers_crash._on_unknown_line): never a clean log
    "Error", "ERROR", "FATAL", "Check failed",
)


def by_first_char(words: tuple[str, ...]) -> str:
    """``a|b|...`` grouped by first character (``O(?:VERFLOW|OM|...)|...``): at a position whose character starts
    an anchor, `re` then tries one branch per first character instead of every anchor (25% faster on real logs,
    2.5x on a run of such a character)."""
    groups: dict[str, list[str]] = {}
    for w in words:
        groups.setdefault(w[0], []).append(w[1:])
    return "|".join(re.escape(c) + (f"(?:{'|'.join(map(re.escape, rest))})" if len(rest) > 1 else re.escape(rest[0]))
                    for c, rest in groups.items())


#: Process exits, searched on their own: one shared prefix is found by a fast literal search, where inside SCAN_RE
#: every "x" (a line of x's: 20 MB/s) made `re` try them.
EXIT_SCAN_RE = re.compile(r"xit(?:s with return code|code| code|ed with)")
#: Lightning's progress bar pads a number to 5 characters (``Tqdm.format_num``, lightning
#: ``pytorch/callbacks/progress/tqdm_progress.py``, 1.x-2.5): nan becomes ``nan.0`` (and inf ``inf.0``)
_NONFINITE = r"(?:tensor\()?[-+]?(?i:nan|inf(?:inity)?)(?:\.0+(?!\d))?(?!\w|\.\w)"
#: What stands between a loss's name and its value: ``loss': nan`` / ``"loss": NaN`` / ``loss=nan`` / ``loss: inf`` /
#: ``train_loss = -inf`` / ``Loss nan`` / ``| loss   | nan |`` (a table) / ``[Loss] nan`` / ``Loss is Infinity``.
_LOSS_SEP = r"""(?:['"\]]?[ \t]*[:=|][ \t]*['"]?|['"\]]?[ \t]+(?:is[ \t]+)?)"""
#: (anchored on "oss").
#: A loss's name may go on as a path: composer's console logger prints ``Train loss/train/total: nan``
#: (mosaicml/composer ``composer/loggers/console_logger.py``: ``{prefix}{name}: {value}``), TensorBoard-style
#: names ``loss/total``.
_LOSS_PATH = r"(?:/[\w.-]+)*"
#: ... or go on as a word: Lightning's ``train_loss_step`` / ``train_loss_epoch``, mmdet's ``loss_cls`` (never the
#: loss *scale*: ``loss_scale`` is fp16's, read by the scaler rules)
_LOSS_TAIL = r"(?:_(?!scale)[A-Za-z]\w*)?"
LOSS_SCAN_RE = re.compile(r"oss" + _LOSS_TAIL + _LOSS_PATH + _LOSS_SEP + _NONFINITE)
NORM_SCAN_RE = re.compile(r"""_norm['"]?[ \t]*[:=][ \t]*['"]?""" + _NONFINITE)
#: A finite loss value (checked only after a non-finite one, to tell whether training recovered; a 0 is not one).
FINITE_LOSS_RE = re.compile(
    r"(?P<key>\w*[lL]oss" + _LOSS_TAIL + _LOSS_PATH + ")" + _LOSS_SEP
    + r"(?:tensor\()?(?P<v>[-+]?(?:\d|\.\d)[\d.]*(?:[eE][-+]?\d+)?)")
#: Plain substrings searched with str.find (their first characters are too common for SCAN_RE): each is a pass over
#: the text (~0.3 ms per MB), so they are few and wide. "_scale" finds DeepSpeed's config print (min_loss_scale,
#: 'min_scale', initial_scale_power, 'init_scale') and its update_scale traceback frame; zsh's "segmentation fault";
#: C++'s "terminate called after". ERROR_SCAN_RE finds the lower-case error lines (gcc's and nvcc's "error:",
#: "[error]", "cuda runtime error (N)", DeepSpeed's "kernel execution error.", "nvcc error :") -- "Error" and "ERROR"
#: are anchors of SCAN_RE --, never a metric's "val error 0.05".
NEEDLES = ("_scale", "| loss scale: ", "segmentation fault", "terminate called after", "died due to signal", " nan]",
           "skipped iterations")
#: The lower-case error forms, searched with one regex (its literal prefix "error" makes it one fast pass).
ERROR_SCAN_RE = re.compile(r"error(?:[:\].]| ?\(| +:)")
#: A traceback's frames and its last line (``ValueError: bad``, ``torch.AcceleratorError: CUDA error: ...``,
#: ``KeyboardInterrupt``): searched with str.find only while a traceback is open, from where one starts (each
#: needle is a pass over the buffer: ~25 ms per 40 MB, so none is searched where no traceback can be).
TB_NEEDLES = ('File "', "Error", "Exception", "Interrupt", "Exit", "Iteration", ".py in ", "<ipython-input")
#: The SCAN_ANCHORS that start a traceback (a ``Traceback`` header, a faulthandler dump).
TB_STARTS = ("Traceback (most recent", "Fatal Python error")

# Progress markers, read lazily (only the last one before an event matters).
TQDM_MARKERS = ("it/s", "s/it")
TQDM_RE = re.compile(r"(?:^|[|\s])(\d+)/(\d+) \[[\d:]+|(?:^|[:\s])(\d+)it \[[\d:]+")
#: Bars that are not the training loop (their count is not a step): matched on the text before the count.
TQDM_NOT_TRAINING_RE = re.compile(
    r"(?i)load|download|upload|map|token|generat|eval|predict|valid|test|fetch|resolv|filter|shard|extract|convert"
    r"|sanity|process|saving|writing")
DS_STEP_MARKER = "skipped="
DS_STEP_RE = re.compile(r"step=(\d+), skipped=(\d+)")

# --- the rules: (substring key, regex, handler name) ----------------------------------------------------------
# fp16 loss scaling
OVERFLOW_RE = re.compile(
    r"(?:\[(?:deepspeed|deepscale)\] OVERFLOW! (?:Rank (?P<rank>\d+) )?|Overflow detected\. "
    r"|\[deepspeed\] fp16 dynamic loss scale overflow! )Skipping step\."
    rf"(?: Attempted loss scale: (?P<att>{NUM}), (?:reducing to (?P<new>{NUM})"
    r"|but hysteresis is (?P<hyst>\d+)\. Reducing hysteresis to (?P<hyst2>\d+)))?"
    r"(?P<nonfinite> Gradients are non-finite)?")
GRAD_OVERFLOW_RE = re.compile(r"Grad overflow on iteration:? (\d+)")
REDUCING_RE = re.compile(rf"Reducing dynamic loss scale from ({NUM}) to ({NUM})")
INCREASING_RE = re.compile(rf"Increasing dynamic loss scale from ({NUM}) to ({NUM})")
STATIC_SCALE_RE = re.compile(rf"Using static loss scale of:? ({NUM})")
MIN_SCALE_MESSAGE = "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run."
#: DeepSpeed's message, whole or cut after "minimum" (the last line of a pasted log is often cut mid-word).
MIN_SCALE_RE = re.compile(r"Current loss scale already at minimum(?: - cannot decrease scale anymore\. Exiting run\.)?")
#: An exception line, for a message cut even shorter: recognised by the traceback frame that raised it.
EXCEPTION_LINE_RE = re.compile(r"(?:^|[\s:])Exception: (?P<msg>\S.*?)\s*$")
DS_UPDATE_SCALE_FRAME_RE = re.compile(r"""File "[^"]*loss_scaler\.py", line \d+, in update_scale""")
#: DeepSpeed's config print: ``min_loss_scale=1`` (pydantic repr), ``"min_loss_scale":1`` (its JSON dump),
#: ``'min_scale': 1`` / ``'init_scale': 65536`` (dynamic_loss_scale_args), ``initial_scale_power=16``.
DS_SCALE_CONFIG_RE = re.compile(
    rf"""['"]?(?P<key>min_loss_scale|min_scale|initial_scale_power|init_scale)['"]?[ \t]*[:=][ \t]*(?P<val>{NUM})""")
#: Megatron-DeepSpeed's iteration line (``training_log``): the step, the scale it trains at, the grad norm.
MEGATRON_ITER_RE = re.compile(r"\biteration\s+(?P<it>\d+)/\s*(?P<total>\d+) \|")
MEGATRON_SCALE_RE = re.compile(rf"\| loss scale: (?P<scale>{NUM}) \|")
MEGATRON_NORM_RE = re.compile(r"\| grad norm: (?P<val>[^|\s]+)")
#: Megatron-LM's ``training_log`` counters (megatron/training/training.py, and every fork: Megatron-DeepSpeed,
#: gpt-neox, NeMo's Megatron): the iterations of the interval whose update was skipped (non-finite gradients; in fp16
#: the scaler's overflows) and those whose loss was nan/inf
MEGATRON_COUNTS_RE = re.compile(r"number of skipped iterations:\s*(?P<skipped>\d+)\s*\|\s*number of nan iterations:"
                                r"\s*(?P<nan>\d+)")
#: pip >= 21.2 (``pip/_internal/exceptions.py``, ``InstallationSubprocessError``) boxes a build's output: ``  ╰─> [N
#: lines of output]``, then the N lines indented to the box (6 spaces), then ``[end of output]``
PIP_BOX_RE = re.compile(r"╰─> \[(?P<n>\d+) lines of output\]")
#: fastprogress (fastai's bars, fastprogress/fastprogress.py ``ProgressBar.update``): ``71.39% [6930/9707
#: 3:56:27<1:34:45 0.5432]``, the comment after the times being fastai's smoothed training loss
#: (``ProgressCallback.after_batch``: ``self.pbar.comment = f'{self.smooth_loss:.4f}'``)
FASTPROGRESS_RE = re.compile(r"\d+(?:\.\d+)?% \[(?P<n>\d+)/(?P<total>\d+) [\d:]+<[\d:]+ (?P<val>[-+]?(?i:nan|inf))\]")
#: A custom trainer printing its GradScaler's scale (``Fp16 Grad Scale:  0``) and the step.
GRAD_SCALE_RE = re.compile(rf"(?i:fp16 )?Grad Scale:[ \t]*(?P<scale>{NUM})")
GLOBAL_STEP_RE = re.compile(r"Global Step:[ \t]*(\d+)")
#: A scale a trainer prints with its metrics (fairseq's progress ``loss_scale=0.0078``, NVIDIA DeepLearningExamples'
#: DLLogger ``PARAMETER loss_scale : 8192.0``, BEiT's meter): a series read like Megatron's, with no floor known
PRINTED_SCALE_RE = re.compile(rf"\bloss_scale['\"]?[ \t]*[:=][ \t]*(?P<scale>{NUM})")

# non-finite loss / grad norm (full check on the candidate line; the key of each rule is below)
LOSS_RE = re.compile(r"(?P<key>\w*[lL]oss" + _LOSS_TAIL + _LOSS_PATH + ")" + _LOSS_SEP + "(?P<val>" + _NONFINITE
                     + ")")
NORM_RE = re.compile(r"""(?P<key>\w*_norm)['"]?[ \t]*[:=][ \t]*['"]?(?P<val>""" + _NONFINITE + ")")
STEP_KEY_RE = re.compile(r"""['"](?:global_)?step['"]:[ \t]*(\d+)""")
#: The Trainer's ``'loss': 0.0`` (4.x) / ``'loss': '0'`` (5.x): with ``'grad_norm': nan`` the loss was NaN on every
#: step since the last log (``logging_nan_inf_filter`` replaced it by the average of no finite loss: 0).
HF_ZERO_LOSS_RE = re.compile(r"""['"]loss['"]:[ \t]*['"]?[-+]?0(?:\.0*)?(?:[eE][-+]?\d+)?['"]?[ \t]*[,}]""")
#: A finite Trainer grad_norm (searched once per chunk after a non-finite one, like FINITE_LOSS_RE).
HF_FINITE_NORM_RE = re.compile(r"""['"]grad_norm['"]:[ \t]*['"]?[-+]?(?:\d|\.\d)""")
EPOCH_RE = re.compile(r"""['"]epoch['"]:[ \t]*['"]?(\d+(?:\.\d+)?)""")

# memory
CUDA_OOM_RE = re.compile(rf"CUDA out of memory\.(?: Tried to allocate (?P<req>{_SIZE}))?")
#: (torch 2.1-2.2 printed "total capacty": the typo is read too)
CUDA_OOM_GPU_RE = re.compile(
    rf"GPU (?P<gpu>\d+) has a total capacit?y of (?P<total>{_SIZE}) of which (?P<free>{_SIZE}) is free"
    rf"|\(GPU (?P<gpu_old>\d+); (?P<total_old>{_SIZE}) total capacity; (?P<alloc_old>{_SIZE}) already allocated;"
    rf" (?P<free_old>{_SIZE}) free")
CUDA_OOM_FRAG_RE = re.compile(rf"(?P<unalloc>{_SIZE}) is reserved by PyTorch but unallocated")
#: a CUDA out-of-memory without the caching allocator's message: the runtime's own (torch's ``CUDA error: out of
#: memory``, THC's ``cuda runtime error (2) : out of memory``, caffe2's ``error == cudaSuccess. 2 vs 0. ... out of
#: memory``) or only the exception's type
CUDA_OOM_ERROR_RE = re.compile(r"CUDA error: out of memory|OutOfMemoryError|cuda runtime error \(2\) : out of memory"
                               r"|error == cudaSuccess\. 2 vs 0\..*out of memory|Cuda failure '?out of memory")
#: torch >= 2.1's allocator names what holds the GPU (c10/cuda/CUDACachingAllocator.cpp, from NVML): the other
#: processes on it, this process (all its memory, PyTorch's or not), and PyTorch's own part
CUDA_OOM_PROC_RE = re.compile(rf"Process (?P<pid>\d+) has (?P<size>{_SIZE}) memory in use")
CUDA_OOM_SELF_RE = re.compile(rf"this process has (?P<size>{_SIZE}) memory in use")
#: torch 1.x-2.0's ``(GPU 0; 10.76 GiB total capacity; 996.23 MiB already allocated; 8.81 MiB free; 1010.00 MiB
#: reserved in total by PyTorch)``: what the allocator holds (``cached`` in torch <= 1.5)
CUDA_OOM_RESERVED_RE = re.compile(rf"(?P<size>{_SIZE}) (?:reserved in total by PyTorch|cached)")
MEM_GPU_RE = re.compile(rf"MA ({NUM}) GB\s+Max_MA ({NUM}) GB\s+CA ({NUM}) GB\s+Max_CA ({NUM}) GB")
MEM_CPU_RE = re.compile(rf"CPU Virtual Memory:\s+used = ({NUM}) GB, percent = ({NUM})%")
HOST_OOM_RE = re.compile(
    r"Out of memory: Kill(?:ed)? process (?P<pid>\d+)(?: \((?P<comm>[^)]*)\))?"
    r"|Memory cgroup out of memory: Kill(?:ed)? process (?P<pid2>\d+)"
    r"|Detected (?P<n>\d+) oom[-_]kill events?|oom[-_]kill:|OOM Killed|OOM killer")

# process exits
DS_EXIT_RE = re.compile(r"exits with return code = (-?\d+)")
DS_LOCAL_RANK_RE = re.compile(r"--local_rank=(\d+)")
TORCHRUN_FAILED_RE = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
TORCHRUN_EXITCODE_RE = re.compile(r"^\s*exitcode\s*: (-?\d+)(?: \(pid: (\d+)\))?")
TORCHRUN_SIGNAL_RE = re.compile(r"Signal (\d+) \((SIG\w+)\) received by PID (\d+)")
TORCHRUN_HOST_RE = re.compile(r"^\s*host\s{3,}: (\S+)")
TORCHRUN_RANK_RE = re.compile(r"^\s*rank\s{3,}: (\d+) \(local_rank: (\d+)\)")
SPAWN_RE = re.compile(r"process (\d+) terminated with (?:signal (SIG\w+)|exit code (\d+))")
SUBPROCESS_SIGNAL_RE = re.compile(r"died with <Signals\.(SIG\w+): (\d+)>")
#: bash's "Killed" on a line of its own, or written right after a progress bar that had no newline yet (tqdm's
#: ``... 7.5it/s]Killed``: text after a bar is a line of its own)
BASH_KILLED_RE = re.compile(r"(?:^|(?:it/s|s/it)[^\]\n]{0,80}\])\s*Killed\s*$|: line \d+: +(\d+) Killed\b")
#: zsh's notice of the same SIGKILL, in its lower-case signal words padded to a column: ``zsh: killed     python
#: train.py``, or a job's ``[1]  + 26478 killed     python train.py`` (also right after a progress bar)
ZSH_KILLED_RE = re.compile(r"(?:^|\]|zsh: )\s*(?:\[\d+\]\s+[+-]?\s*(\d+)\s+)?killed {2,}\S")
SIGTERM_SENT_RE = re.compile(r"Sending process (\d+) closing signal (SIG\w+)")
#: slurmstepd (SchedMD/slurm ``src/slurmd/slurmstepd/req.c`` and ``mgr.c``, 17.x-24.x): "*** JOB|STEP {id} ON {node}
#: CANCELLED AT {time} DUE TO TIME LIMIT|PREEMPTION|NODE FAILURE, SEE SLURMCTLD LOG FOR DETAILS ***", without "DUE TO"
#: for scancel; releases before 17 wrote "*** JOB {id} CANCELLED AT {time} DUE TO TIME LIMIT on {node} ***"
SLURM_CANCEL_RE = re.compile(
    r"\*\*\* (?P<what>JOB|STEP) (?P<id>[\w.+]+) (?:ON (?P<node>\S+) )?CANCELLED AT (?P<at>\S+)"
    r"(?: DUE TO (?P<why>[A-Z][A-Z ]*[A-Z]))?(?:, SEE SLURMCTLD LOG FOR DETAILS)?(?: on (?P<node2>\S+))?[^*]*\*\*\*")

# crashes (see handlers_crash.py)
_PFX = r"^(?:\[(?:rank|default)\d+\]:[ ]?)?"
#: Python's ``Traceback (most recent call last):``, or IPython's header that names the exception first
#: (``ImportError        Traceback (most recent call last)``: its frames are ``path in func()`` blocks)
TRACEBACK_RE = re.compile(r"(?:(?P<type>(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit))\s{2,})?"
                          r"Traceback \(most recent call last\)(?P<colon>:)?")
#: A traceback frame (``  File "x.py", line 3, in f``) or a faulthandler one (``  File "x.py", line 3 in f``).
FRAME_RE = re.compile(_PFX + r'\s*File "(?P<file>[^"]+)", line (?P<ln>\d+),?\s+in (?P<fn>.*?)\s*$')
#: An IPython / Jupyter / Colab frame: ``/usr/lib/python3/dist-packages/mmcv/ops/bbox.py in <module>()`` (no line
#: number on it: the code lines below carry them, the failing one marked ``---->``).
IPYTHON_FRAME_RE = re.compile(r"^(?P<file>\S+?\.py|<ipython-input-[^>]+>)\s+in\s+(?P<fn><?[\w.]+>?)\((?P<ln>)")
#: The exception line that ends a traceback: a dotted class name, then ``: message`` or nothing.
EXC_LINE_RE = re.compile(_PFX + r"(?P<type>(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*"
                         r"(?:Error|Exception|Interrupt|Exit|Iteration|Warning|Failure|Fault|Timeout))"
                         r"(?::[ \t]*(?P<msg>.*?))?\s*$")
FATAL_PY_RE = re.compile(r"Fatal Python error: (?P<what>[^\n]*?)\s*$")
#: What a shell (bash, Slurm's script) prints when the command died of a signal; ``Aborted`` alone only with the
#: shell's ``line N: PID`` prefix or ``(core dumped)``.
SHELL_SIGNAL_RE = re.compile(
    r"(?:^|: line \d+: +(?P<pid>\d+) |(?P<zsh>zsh: ))"
    r"(?P<name>(?i:segmentation fault|bus error|illegal instruction|illegal hardware instruction|floating point "
    r"exception)|Aborted|abort(?= ))"
    r"(?P<core>\s+\(core dumped\))?(?P<rest>.*)$")
CPP_TERMINATE_RE = re.compile(r"terminate called after throwing an instance of '(?P<type>[^']+)'")
CPP_WHAT_RE = re.compile(_PFX + r"\s*what\(\):\s*(?P<msg>.*?)\s*$")
DATALOADER_KILLED_RE = re.compile(
    r"DataLoader worker \(pid (?P<pid>\d+)\) is killed by signal: (?P<name>[A-Za-z ]+?)\.")
#: CUDA runtime errors (torch's ``CUDA error: <cudaGetErrorString>``, flash-attn/NCCL's ``Cuda failure '...'``).
#: CUDA runtime errors in every torch era's words (cudaGetErrorString's texts inside them): torch >= 1.x
#: ``CUDA error: <text>`` (c10/cuda/CUDAException.cpp), THC (torch <= 1.10: aten/src/THC/THCGeneral.cpp)
#: ``THCudaCheck FAIL file=F line=L error=N : <text>`` and ``cuda runtime error (N) : <text> at F:L``, other programs'
#: (caffe's ``Cuda kernel failed. Error: <text>``) and the bare texts.
CUDA_ERROR_RE = re.compile(
    r"CUDA error: (?P<msg>.*?)\s*$"
    r"|cuda runtime error \((?P<code>\d+)\) : (?P<msg2>.*?)(?: at \S+:\d+)?\s*$"
    r"|THCudaCheck FAIL file=\S+ line=\d+ error=(?P<code2>\d+) : (?P<msg3>.*?)\s*$"
    r"|(?P<bare>an illegal memory access was encountered|no kernel image is available for execution on the device"
    r"|device-side assert triggered|unspecified launch failure|misaligned address|an illegal instruction was "
    r"encountered)")
#: cuBLAS and cuDNN failures (torch's ``CUDA error: CUBLAS_STATUS_... when calling ...``, ``cuDNN error: CUDNN_STATUS_
#: ...``; other programs' ``CUBLAS failure 13: CUBLAS_STATUS_EXECUTION_FAILED``), and DeepSpeed's transformer kernel's
#: ``!!!! kernel execution error. (m: M, n: N, k: K, error: S)`` (csrc/includes/cublas_wrappers: a cuBLAS status).
CUDA_LIBRARY_RE = re.compile(r"(?P<status>CUBLAS_STATUS_[A-Z_]+|CUDNN_STATUS_[A-Z_]+)"
                             r"|!!!! kernel execution error\. \(m: \d+, n: \d+, k: \d+, error: (?P<code>\d+)\)")
CUDA_DRIVER_RE = re.compile(
    r"CUDA driver version is insufficient for CUDA runtime version"
    r"|The NVIDIA driver on your system is too old \(found version (?P<found>\d+)\)")
#: torch's warning before a "no kernel image" error: the GPU's capability and the wheel's arch list.
CUDA_CAPABILITY_RE = re.compile(
    r"with CUDA capability (?P<cap>sm_\d+\w?) is not compatible with the current PyTorch installation"
    r"(?:\.\s*The current PyTorch install supports CUDA capabilities (?P<archs>(?:sm_\d+\w?\s*)+))?")
#: ... whose next line (torch prints it on its own line) lists the wheel's architectures.
CUDA_ARCHS_RE = re.compile(r"The current PyTorch install supports CUDA capabilities (?P<archs>(?:sm_\d+\w?\s*)+)")
XID_RE = re.compile(r"NVRM: Xid \((?P<pci>[^)]*)\): (?P<code>\d+),\s*(?P<rest>.*?)\s*$")
ECC_RE = re.compile(r"(?i:uncorrectable ECC error|ECC error)")
#: A line worth quoting when a run failed with no recognised cause.
ERRORISH_RE = re.compile(r"(?i:error|exception|traceback|fatal|failed|failure|abort|killed|segmentation|core dumped"
                         r"|cannot|unable|denied|not found|no such)")
DEVICE_ASSERT_RE = re.compile(r"Assertion `(?P<cond>[^`]*)` failed")
#: An error line no rule knows, at the end of a failed run: a FATAL, a C++ ``terminate called``, an abort, or an
#: ``ERROR``/``Error``/``error`` label (``error: ...``, ``[ERROR]``, ``| ERROR |``, ``ERROR -``), not the word in prose
#: (``error rate``, ``errors: 0``, ``no error``).
#: A metric named "error" (``Top-1 error: 12.3%``, ``val error: 0.05``, ``Test Error: `` before the accuracy) is no
#: error: a label followed by a number or by nothing is skipped; ``FATAL`` counts as a label, not in prose.
ERROR_LINE_RE = re.compile(r"(?:^|[\[|(])\s*FATAL\b|\bFATAL(?::|\])|\bFatal error\b|\bterminate called\b|^\s*Aborted\b"
                           r"|\bCheck failed\b"
                           r"|(?:^|[\s\[|:])(?:ERROR|Error|error)(?::|\]|\s+\||\s+-\s)(?!\s*(?:[-+]?\.?\d|$))")
#: Words one of which an error line no rule knows holds (ERROR_LINE_RE, an exception type of ERROR_TYPE_ENDINGS):
#: a cheap test before the regexes.
ERROR_WORDS = ("rror", "ERROR", "FATAL", "Fatal", "terminate called", "Aborted", "Check failed", "Exception", "Failure",
               "Fault", "Timeout", "Interrupt", "Exit")
#: The exception types an exception line must end in to report an error (``UserWarning: ...`` does not).
ERROR_TYPE_ENDINGS = ("Error", "Exception", "Failure", "Fault", "Timeout", "Interrupt", "Exit")
#: What launchers print after a worker failed, skipped when looking for the worker's last words: torch elastic's
#: glog lines (``E1204 12:00:00.123 2815 torch/.../api.py:1002] failed (exitcode: 1) ...``) and rules of = or -.
LAUNCHER_TRAILER_RE = re.compile(r"^[EWI]\d{3,4} \d\d:\d\d:\d\d(?:\.\d+)? +\d+ \S+:\d+\] |^\s*[=\-]{10,}\s*$")

# DeepSpeed config
DS_BF16_FP16_RE = re.compile(r"bfloat16 and fp16 modes cannot be simultaneously enabled")
DS_BATCH_RE = re.compile(
    r"train_batch_size is not equal to micro_batch_per_gpu \* gradient_acc_step \* world_size"
    r" (\d+) != (\d+) \* (\d+) \* (\d+)")

#: (substring that must be present, regex, Analyzer handler method). Checked in order on every candidate line.
#: A traceback's frames and exception line (FRAME_RE, EXC_LINE_RE) are not here: they are tried only while a
#: traceback is open (scan.Scanner._segment), so ordinary lines pay nothing for them.
RULES: tuple[tuple[str, re.Pattern[str], str], ...] = (
    ("OVERFLOW", OVERFLOW_RE, "_on_overflow"),
    ("Overflow detected", OVERFLOW_RE, "_on_overflow"),
    ("loss scale overflow!", OVERFLOW_RE, "_on_overflow"),
    ("Grad overflow on iteration", GRAD_OVERFLOW_RE, "_on_grad_overflow"),
    ("Reducing dynamic loss scale", REDUCING_RE, "_on_reducing"),
    ("Increasing dynamic loss scale", INCREASING_RE, "_on_increasing"),
    ("Using static loss scale", STATIC_SCALE_RE, "_on_static_scale"),
    ("Current loss scale already at minimum", MIN_SCALE_RE, "_on_min_scale"),
    ("Exception: ", EXCEPTION_LINE_RE, "_on_exception_line"),
    ("in update_scale", DS_UPDATE_SCALE_FRAME_RE, "_on_ds_update_scale_frame"),
    ("_scale", DS_SCALE_CONFIG_RE, "_on_scale_config"),
    ("| loss scale: ", MEGATRON_SCALE_RE, "_on_megatron_iteration"),
    ("Grad Scale:", GRAD_SCALE_RE, "_on_grad_scale"),
    ("number of nan iterations", MEGATRON_COUNTS_RE, "_on_megatron_counts"),
    ("lines of output]", PIP_BOX_RE, "_on_pip_box"),
    ("% [", FASTPROGRESS_RE, "_on_fastprogress"),
    ("loss_scale", PRINTED_SCALE_RE, "_on_printed_scale"),
    ("oss", LOSS_RE, "_on_loss"),
    ("_norm", NORM_RE, "_on_norm"),
    ("CUDA out of memory", CUDA_OOM_RE, "_on_cuda_oom"),
    ("ut of memory", CUDA_OOM_ERROR_RE, "_on_cuda_oom_error"),
    ("OutOfMemoryError", CUDA_OOM_ERROR_RE, "_on_cuda_oom_error"),
    ("Max_MA", MEM_GPU_RE, "_on_mem_gpu"),
    ("CPU Virtual Memory", MEM_CPU_RE, "_on_mem_cpu"),
    ("ut of memory", HOST_OOM_RE, "_on_host_oom"),
    ("oom", HOST_OOM_RE, "_on_host_oom"),
    ("OOM", HOST_OOM_RE, "_on_host_oom"),
    ("exits with return code", DS_EXIT_RE, "_on_ds_exit"),
    ("failed (exitcode", TORCHRUN_FAILED_RE, "_on_torchrun_failed"),
    ("exitcode", TORCHRUN_EXITCODE_RE, "_on_torchrun_exitcode"),
    ("received by PID", TORCHRUN_SIGNAL_RE, "_on_torchrun_signal"),
    ("host ", TORCHRUN_HOST_RE, "_on_torchrun_host"),
    ("(local_rank:", TORCHRUN_RANK_RE, "_on_torchrun_rank"),
    ("terminated with", SPAWN_RE, "_on_spawn"),
    ("died with <Signals", SUBPROCESS_SIGNAL_RE, "_on_subprocess_signal"),
    ("Killed", BASH_KILLED_RE, "_on_bash_killed"),
    ("killed  ", ZSH_KILLED_RE, "_on_bash_killed"),
    ("closing signal", SIGTERM_SENT_RE, "_on_sigterm_sent"),
    ("CANCELLED AT", SLURM_CANCEL_RE, "_on_slurm_cancel"),
    ("Traceback (most recent", TRACEBACK_RE, "_on_traceback"),
    ("Fatal Python error", FATAL_PY_RE, "_on_fatal_python"),
    ("terminate called after", CPP_TERMINATE_RE, "_on_cpp_terminate"),
    ("is killed by signal", DATALOADER_KILLED_RE, "_on_dataloader_killed"),
    ("CUDA driver version", CUDA_DRIVER_RE, "_on_cuda_driver"),
    ("NVIDIA driver", CUDA_DRIVER_RE, "_on_cuda_driver"),
    ("is not compatible with the current PyTorch", CUDA_CAPABILITY_RE, "_on_cuda_capability"),
    ("CUDA_STATUS_", CUDA_LIBRARY_RE, "_on_cuda_library"),
    ("CUBLAS_STATUS_", CUDA_LIBRARY_RE, "_on_cuda_library"),
    ("CUDNN_STATUS_", CUDA_LIBRARY_RE, "_on_cuda_library"),
    ("kernel execution error", CUDA_LIBRARY_RE, "_on_cuda_library"),
    ("CUDA error", CUDA_ERROR_RE, "_on_cuda_error"),
    ("cuda runtime error", CUDA_ERROR_RE, "_on_cuda_error"),
    ("THCudaCheck", CUDA_ERROR_RE, "_on_cuda_error"),
    ("illegal memory access", CUDA_ERROR_RE, "_on_cuda_error"),
    ("no kernel image", CUDA_ERROR_RE, "_on_cuda_error"),
    ("device-side assert", CUDA_ERROR_RE, "_on_cuda_error"),
    ("unspecified launch failure", CUDA_ERROR_RE, "_on_cuda_error"),
    ("misaligned address", CUDA_ERROR_RE, "_on_cuda_error"),
    ("illegal instruction was", CUDA_ERROR_RE, "_on_cuda_error"),
    ("Assertion `", DEVICE_ASSERT_RE, "_on_device_assert"),
    ("NVRM: Xid", XID_RE, "_on_xid"),
    ("ECC error", ECC_RE, "_on_ecc"),
    ("Segmentation fault", SHELL_SIGNAL_RE, "_on_shell_signal"),
    ("segmentation fault", SHELL_SIGNAL_RE, "_on_shell_signal"),
    ("zsh: ", SHELL_SIGNAL_RE, "_on_shell_signal"),
    ("Bus error", SHELL_SIGNAL_RE, "_on_shell_signal"),
    ("Illegal instruction", SHELL_SIGNAL_RE, "_on_shell_signal"),
    ("Floating point exception", SHELL_SIGNAL_RE, "_on_shell_signal"),
    ("Aborted", SHELL_SIGNAL_RE, "_on_shell_signal"),
    ("bfloat16 and fp16 modes", DS_BF16_FP16_RE, "_on_ds_bf16_fp16"),
    ("train_batch_size is not equal", DS_BATCH_RE, "_on_ds_batch"),
)
