"""Where the gate's original-mix figure and serving's part, step 2 (one real server of the bundled pair, the default
config, prefix cache on): the gate's original-mix prompts (GAP_DIR/orig_eval.pt, greedy, 96 new tokens, 8 at a time)
served by the bundled drafter; the candidate hot-swapped in as the learner swaps it but without the flush (so the
draft KV the old drafter wrote for cached prefixes stays); the same prompts again (every prompt a cached prefix);
/flush_cache; the same prompts (draft KV of the new drafter only), and once more. Each pass: the served acceptance,
the drafter's full-block acceptance from the per-position counters (as learning_ab.py computes it), per position
tries and p_j, prefix-cache hits. `fresh`: a server started on the candidate instead, two passes.

    GAP_DIR=/tmp/learning_gap python benchmarks/learning_gap_serve.py GAP_DIR/cand swap|fresh [dflash_adaptive|dflash]

EXP_N prompts (64), EXP_FULL=1: the adaptive worker drafts the full block at every width (DFLASH_SERVE_FULL_DRAFTS).
Writes GAP_DIR/serve_<mode>_<algorithm>_<candidate>.json.
"""
import json, os, sys, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import torch, yaml
REPO = Path(__file__).resolve().parents[1]; sys.path.insert(0, str(REPO)); sys.path.insert(0, str(REPO / "benchmarks"))
from harness.server import ManagedServer, http_json
from loadtest import server_metrics
from learning_ab import window
from dflash_models.learn import swap
ADMIN_ENV, ADMIN = "DFLASH_EXP_ADMIN", "exp-admin-key"
os.environ[ADMIN_ENV] = ADMIN
out = Path(os.environ.get("GAP_DIR", "/tmp/learning_gap"))
cand, which = Path(sys.argv[1]), sys.argv[2]
algo = sys.argv[3] if len(sys.argv) > 3 else "dflash_adaptive"
N = int(os.environ.get("EXP_N", "64"))
while not (out / "orig_eval.pt").exists(): time.sleep(5)  # written by learning_gap_offline.py
time.sleep(2)
ev = torch.load(out / "orig_eval.pt")
prompts = [s[:st] for s, st in zip(ev["sequences"], ev["starts"])][:N]
base = REPO / "deploy/configs/cpu.yaml"
cfg = yaml.safe_load(base.read_text())
cfg["model"]["path"] = str(REPO / "models/tiny-code/target")
cfg["speculative"]["draft_model_path"] = str(REPO / "models/tiny-code/drafter") if which == "swap" else str(cand)
cfg["speculative"]["algorithm"] = algo
cfg["server"] |= {"admin_api_key_env": ADMIN_ENV, "cpu_threads": 1, "max_running_requests": 16}

def gen(s, p):
    body = {"input_ids": p, "sampling_params": {"temperature": 0, "max_new_tokens": 96}}
    return http_json(f"{s.url}/generate", body, timeout=900)

def phase(s, label):
    b = server_metrics.scrape(f"{s.url}/metrics"); t = time.time()
    with ThreadPoolExecutor(8) as ex:
        outs = list(ex.map(lambda p: gen(s, p), prompts))
    a = server_metrics.scrape(f"{s.url}/metrics")
    w = window(b, a, time.time() - t)
    from learning_ab import _by_position
    ta, tb = (_by_position(x, "dflash_tried_tokens_by_position_total") for x in (a, b))
    aa, ab = (_by_position(x, "dflash_accepted_tokens_by_position_total") for x in (a, b))
    w["tried"] = [int(ta[k] - tb.get(k, 0)) for k in sorted(ta)]
    w["p"] = [round((aa.get(k, 0) - ab.get(k, 0)) / max(1, ta[k] - tb.get(k, 0)), 3) for k in sorted(ta)]
    w["label"] = label; w["seconds"] = round(time.time() - t, 1)
    w["cached_tokens"] = sum(o["meta_info"].get("cached_tokens", 0) for o in outs)
    print(json.dumps(w), flush=True)
    return w, [o["output_ids"] for o in outs]

res = []
env = {ADMIN_ENV: ADMIN, **({"DFLASH_SERVE_FULL_DRAFTS": "1"} if os.environ.get("EXP_FULL") else {})}
with ManagedServer(cfg, out / "srv", f"{which}_{algo}{os.environ.get('EXP_FULL', '')}", env=env, cwd=REPO) as s:
    if which == "swap":
        w, o0 = phase(s, "static"); res.append(w)
        base_url = s.url
        while not (out / "offline.json").exists(): time.sleep(5)
        swap._post(f"{base_url}/pause_generation", {"mode": "in_place"}, ADMIN, 60)
        swap._post(f"{base_url}/begin_weight_update", {"selector": "draft"}, ADMIN, 60)
        enc = swap.payloads(cand)
        for i, c in enumerate(enc):
            body = {"serialized_named_tensors": [c], "selector": "draft", "flush_cache": False,
                    "weight_version": "cand" if i == len(enc) - 1 else None}  # as swap.push, without the flush
            r = swap._post(f"{base_url}/update_weights_from_tensor", body, ADMIN, 60)
            assert r.get("success"), r
        swap._post(f"{base_url}/end_weight_update", {}, ADMIN, 60)
        swap._post(f"{base_url}/continue_generation", {}, ADMIN, 60)
        w, o1 = phase(s, "swapped, cache kept"); res.append(w)
        print("flush", swap._post(f"{base_url}/flush_cache", {}, ADMIN, 60), flush=True)
        w, o2 = phase(s, "swapped, cache flushed"); res.append(w)
        w, o3 = phase(s, "swapped, flushed, 2nd pass (cache warm, new drafter)"); res.append(w)
        print("same outputs", o0 == o1 == o2 == o3)
    else:
        w, o = phase(s, f"fresh {cand.name}"); res.append(w)
        w, o = phase(s, f"fresh {cand.name} 2nd pass"); res.append(w)
(out / f"serve_{which}_{algo}{os.environ.get('EXP_FULL', '')}_{cand.name}.json").write_text(json.dumps(res, indent=1))
