"""The vision-tower probes behind training/README.md's muse-tiny-mm diagnosis (CPU, one thread each).

muse-tiny-mm's vision tower, adapter and projection (transformers' init) with linear heads on the
mean of the image tokens (shape, colour, count) and optionally per-token heads (--dense: the token
holding a shape's centre; --mask: shape or background on tokens the shapes' discs cover more than
this share of), trained alone on --pool training images; accuracy of the pooled heads on 300
held-out images every 100 steps. --size/--rscale redraw the images larger (media_data's drawing,
copied here with those two knobs). results.jsonl holds each run's arguments and curve, e.g.

    OMP_NUM_THREADS=1 python training/runs/vision-probes-2026-12-02/probe.py --size 112 --steps 2000 \
        --pool 4000 --dense 1.0 --mask 0.15
"""
import argparse, json, math, random, sys, time
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
import numpy as np, torch, torch.nn.functional as F
import media_data as md
import train_multimodal_demo as t

ap = argparse.ArgumentParser()
ap.add_argument("--size", type=int, default=112)
ap.add_argument("--rscale", type=float, default=1.0)
ap.add_argument("--steps", type=int, default=300)
ap.add_argument("--batch", type=int, default=32)
ap.add_argument("--pool", type=int, default=2000)
ap.add_argument("--lr", type=float, default=2e-3)
ap.add_argument("--layers", type=int, default=2)
ap.add_argument("--hidden", type=int, default=96)
ap.add_argument("--inter", type=int, default=256)
ap.add_argument("--dense", type=float, default=0.0, help="weight of per-token dense aux (centre/shape map)")
ap.add_argument("--supersample", type=int, default=4)
ap.add_argument("--tag", default="")
ap.add_argument("--mask", type=float, default=0.0)
args = ap.parse_args()
torch.manual_seed(0)

from PIL import Image, ImageDraw
def draw(rng, S, rs, ss):
    shape, colour, count = rng.choice(md.SHAPES), rng.choice(sorted(md.COLOURS)), rng.randint(1, md.MAX_COUNT)
    size = S * ss
    bg = tuple(rng.randint(215, 255) for _ in range(3))
    img = Image.new("RGB", (size, size), bg); d = ImageDraw.Draw(img)
    placed = []
    for _ in range(count):
        for _a in range(500):
            r = rng.uniform(8.0 * rs, (15.0 if count > 2 else 20.0) * rs) * ss
            m = r + 2 * ss
            cx, cy = rng.uniform(m, size - m), rng.uniform(m, size - m)
            if all(math.hypot(cx - x, cy - y) > r + q + 3 * ss for x, y, q in placed):
                break
        else:
            raise RuntimeError("place")
        placed.append((cx, cy, r))
        fill = tuple(min(255, max(0, c + rng.randint(-md.JITTER, md.JITTER))) for c in md.COLOURS[colour])
        ang = rng.uniform(-0.3, 0.3)
        if shape == "circle":
            d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
        else:
            d.polygon(md._polygon(shape, cx, cy, r * (1.25 if shape == "triangle" else 1.0), ang), fill=fill)
    mask = Image.new("L", (size, size), 0); dm = ImageDraw.Draw(mask)
    for cx, cy, r in placed:
        dm.ellipse([cx - r, cy - r, cx + r, cy + r], fill=255)
    img = img.resize((S, S), Image.Resampling.LANCZOS)
    cell = 28 * ss
    cov = np.asarray(mask, dtype=np.float32).reshape(S // 28, cell, S // 28, cell).mean((1, 3)) / 255
    cells = ([(cx / ss, cy / ss) for cx, cy, _ in placed], cov.reshape(-1))
    return np.asarray(img, dtype=np.uint8), (md.SHAPES.index(shape), sorted(md.COLOURS).index(colour), count - 1), cells

def make(split, n):
    out = [draw(random.Random(f"image:{split}:{i}"), args.size, args.rscale, args.supersample) for i in range(n)]
    return (torch.from_numpy(np.stack([o[0] for o in out])), torch.tensor([o[1] for o in out]), [o[2] for o in out])

t0 = time.time()
Xtr, Ytr, Ctr = make("train", args.pool)
Xte, Yte, Cte = make("heldout", 300)
draw_s = time.time() - t0
from transformers import MuseSparkConfig, MuseSparkForConditionalGeneration
vc = dict(hidden_size=args.hidden, intermediate_size=args.inter, num_hidden_layers=args.layers, num_attention_heads=2)
if args.layers != 2:
    vc["layer_types"] = ["window_attention"] * (args.layers - 1) + ["full_attention"]
cfg = MuseSparkConfig(text_config=dict(t.TEXT_CONFIG, vocab_size=t.VOCAB, num_hidden_layers=1, mlp_layer_types=["dense"]),
                      vision_config=vc, audio_config=dict(t.AUDIO_CONFIG),
                      **dict(t.TOP_CONFIG, out_hidden_size=4 * args.hidden))
full = MuseSparkForConditionalGeneration(cfg)
tower, adapter, proj, norm = full.model.vision_tower, full.model.vision_adapter, full.model.vision_projection, full.model.perception_emb_norm
g = args.size // 14
tok = (g // 2) ** 2
heads = torch.nn.ModuleDict({"shape": torch.nn.Linear(256, 4), "colour": torch.nn.Linear(256, 6), "count": torch.nn.Linear(256, 4),
                             "dshape": torch.nn.Linear(256, 5), "dcentre": torch.nn.Linear(256, 2)})
params = list(tower.parameters()) + list(adapter.parameters()) + list(proj.parameters()) + list(heads.parameters())
opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05)
ntower = sum(p.numel() for p in tower.parameters())

def feats(X):
    pv = t.pixel_values(X)
    grid = torch.tensor([[1, g, g]] * len(X))
    h = tower(pv, grid).last_hidden_state
    return proj(adapter(h)).reshape(len(X), tok, -1)

def dense_targets(C, Y):
    # per merged token (28x28 px cell): centre present (0/1), shape class if centre in it else 4 (background)
    cell = 28
    cen = torch.zeros(len(C), tok, dtype=torch.long); shp = torch.full((len(C), tok), 4, dtype=torch.long)
    for b, (cs, cov) in enumerate(C):
        for cx, cy in cs:
            k = min(g // 2 - 1, int(cy // cell)) * (g // 2) + min(g // 2 - 1, int(cx // cell))
            cen[b, k] = 1; shp[b, k] = Y[b, 0]
        if args.mask:
            shp[b, torch.from_numpy(cov > args.mask)] = Y[b, 0]
    return cen, shp

def evaluate():
    tower.eval()
    with torch.no_grad():
        f = torch.cat([feats(Xte[i:i + 50]) for i in range(0, 300, 50)]).mean(1)
    tower.train()
    return {k: float((heads[k](f).argmax(-1) == Yte[:, j]).float().mean()) for j, k in enumerate(("shape", "colour", "count"))}

log = []
t0 = time.time()
gen = torch.Generator().manual_seed(0)
for step in range(1, args.steps + 1):
    lr = args.lr * min(1, step / 20)
    for gr in opt.param_groups: gr["lr"] = lr
    idx = torch.randint(0, args.pool, (args.batch,), generator=gen)
    f = feats(Xtr[idx]); y = Ytr[idx]; p = f.mean(1)
    loss = sum(F.cross_entropy(heads[k](p), y[:, j]) for j, k in enumerate(("shape", "colour", "count"))) / 3
    if args.dense:
        cen, shp = dense_targets([Ctr[i] for i in idx.tolist()], y)
        loss = loss + args.dense * (F.cross_entropy(heads["dcentre"](f).reshape(-1, 2), cen.reshape(-1))
                                    + F.cross_entropy(heads["dshape"](f).reshape(-1, 5), shp.reshape(-1))) / 2
    opt.zero_grad(); loss.backward(); torch.nn.utils.clip_grad_norm_(params, 1.0); opt.step()
    if step % 100 == 0 or step == args.steps:
        r = evaluate(); r.update(step=step, loss=round(float(loss), 3), s=round(time.time() - t0))
        log.append(r); print(json.dumps(r), flush=True)
print(json.dumps({"final": vars(args), "tower_params": ntower, "tokens": tok, "draw_s": round(draw_s, 1), "log": log}))
