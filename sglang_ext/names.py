"""Every name the plugin shares across processes: the environment variables the product sets or reads, and the
speculative algorithm it registers (one place to grep; no imports, no logic).

Why environment variables: SGLang starts its scheduler and detokenizer in their own processes from its own server
arguments, which have no field for a plugin's settings; environment variables are inherited by every process it
spawns. The launcher (service/launcher.py `server_env`) writes them; the plugin reads them (settings.py, cpu/).
"""
from __future__ import annotations

ALGORITHM = "DFLASH_ADAPTIVE"
"""`--speculative-algorithm` of `speculative.algorithm: dflash_adaptive` (registered by spec_algo.py; the name-site
patches answer for it as for DFLASH)."""

# Sent by the plugin from one of SGLang's processes to another -----------------------------------------------------
ROLLBACK_RID = "dflash-serve-rollback"
"""The `rid` of an /end_weight_update the HTTP process sends when a weight-update session's client is gone
(patches/pause_lease.py): the scheduler then restores the draft weights the session began with before ending it
(patches/drafter_swap.py) instead of keeping what was loaded."""

# Set by the launcher, read by the plugin ------------------------------------------------------------------------
CPU = "DFLASH_SERVE_CPU"
"""'1' activates the CPU layer: the `.pth` start-up hook (cpu/startup.py) and the CPU patches. The hook line in
`sglang_ext/cpu/dflash_serve_cpu.pth` spells the name out (a .pth line cannot import this module)."""
ADAPTIVE = "DFLASH_SERVE_ADAPTIVE"
"""JSON of settings.AdaptiveSettings: the DFLASH_ADAPTIVE worker's controller settings, built and validated once by
the launcher (service/config.py) and read once by the worker."""
HTTP = "DFLASH_SERVE_HTTP"
"""JSON of settings.HttpSettings; its presence activates patches/http_guard.py (only under `dflash-serve`)."""
CAPTURE = "DFLASH_SERVE_CAPTURE"
"""JSON of settings.CaptureSettings: where and how much served traffic the scheduler keeps for `dflash-serve learn`
(the `learning:` section); its presence turns capture on (patches/capture_finish.py, capture.py)."""
API_KEY = "DFLASH_SERVE_SGLANG_API_KEY"
"""The API key on its way to `sglang serve` (service/server_entry.py moves it into argv inside the process and
deletes it): never on a command line, which every user can read."""
ADMIN_API_KEY = "DFLASH_SERVE_SGLANG_ADMIN_API_KEY"
"""The admin key (`server.admin_api_key_env`) on its way to `sglang serve` as its `--admin-api-key` and to the
fleet's router as its control-plane key, as API_KEY travels. Without one the server makes up a key nobody holds, so
SGLang's admin routes stay closed to every client (service/server_entry.py)."""
SGLANG_ARGS = "DFLASH_SERVE_SGLANG_ARGS"
"""JSON of the config's `sglang_args`: checked against SGLang's own parser by the server process
(service/server_entry.py), which imports SGLang anyway, so the launcher need not."""

# Set by tests, read by the plugin ----------------------------------------------------------------------------------
TRITON_ON_CPU = "DFLASH_SERVE_TRITON_ON_CPU"
"""'1' (with TRITON_INTERPRET=1, device cpu): the DFLASH_ADAPTIVE worker takes upstream's Triton branches that SGLang
guards by CUDA checks -- prepare-block and greedy accept/bonus -- and Triton's interpreter runs those kernels on
CPU tensors. A CI test mode for GPU-only code (tests/integration/test_triton_kernels.py), never a serving mode."""
TRITON_INTERPRET = "TRITON_INTERPRET"
EAGER_APPEND = "DFLASH_SERVE_EAGER_DRAFT_APPEND"
"""'1': the DFLASH_ADAPTIVE worker writes the draft-KV append of width-1 steps every step instead of deferring it to
one batched pass (worker.py). The reference the deferred append is tested against (tests/integration/
test_adaptive_pausing.py); also a switch for an operator who suspects the deferral."""
FULL_DRAFTS = "DFLASH_SERVE_FULL_DRAFTS"
"""'1': the DFLASH_ADAPTIVE worker drafts the full block at every width > 1 on CPU too, as on GPU (worker.py, step
2): the reference prefix drafts are measured against (benchmarks/step_profile.py, the sweep's variants)."""
GPU_TREES = "DFLASH_SERVE_GPU_TREES"
"""'1': tree widths (DDTree, candidates above the drafter's block) are served on GPU, which verifies them on
FlashInfer or Triton from a verify CUDA graph per tree width (verify_runtimes.py). Refused without it until the GPU
suite (tests/gpu/test_gpu_serving.py) has passed on a GPU: the GPU tree path is built and pinned to upstream's
source but has not served on one yet. Read by the preflight and the worker."""

# Set by the launcher for SGLang / OpenMP --------------------------------------------------------------------------
SGLANG_POST_CAPTURE_KV_SIZING = "SGLANG_ENABLE_POST_CAPTURE_KV_SIZING"
"""'1' on GPU for dflash_adaptive unless the user set it: SGLang backs the KV pool after CUDA-graph capture from
the free memory it then measures, so the worker's per-width verify graphs (captured after the pool is sized) are
counted (docs/ARCHITECTURE.md §7)."""
SGLANG_MAMBA_CONV_DTYPE = "SGLANG_MAMBA_CONV_DTYPE"
"""'float32' on CPU for a float32 model unless the user set it: a hybrid target's conv state is otherwise bf16, so a
prefill (which reads its own inputs unrounded) and decoding (which reads them back from the state) would compute
different values for the same tokens -- a request re-prefilled after a retraction would not continue as it would
have decoded. No effect on a model without conv layers."""
SGLANG_CPU_ENGINE = "SGLANG_USE_CPU_ENGINE"
OMP_THREADS = "OMP_NUM_THREADS"
