"""Fuzz ``rlx.nn.Module.load`` with mutated safetensors files (not part of CI).

Seeds are valid checkpoints written by ``Module.save``. Each input is mutated either structurally
(the JSON header: huge / negative / float sizes and offsets, swapped or overlapping offsets,
duplicate names, odd dtypes, header length lies, truncation, appended bytes) or as raw bytes
(atheris / libFuzzer mutations), written to a file and loaded into a compiled model.

A finding is:
* ``crash``: the interpreter died (signal / abort) or a per-input timeout (a hang);
* ``exception``: anything other than ``rlx.CheckpointError`` was raised;
* ``changed-on-error``: a refused load changed the weights;
* ``wrong-values``: an accepted load does not hold the tensors an independent strict reader sees;
* ``lenient`` (counted, reported, not a failure by itself): a file that the independent reader
  rejects (e.g. duplicate names) was accepted.

    python scripts/fuzz_checkpoint.py [--seconds 60] [--out fuzz-findings] [--plain]

Uses atheris when it is installed (``--plain`` forces the built-in random-mutation loop). A
supervisor restarts the fuzzing process after a crash until the time budget is spent, and prints
the number of executions and the findings (inputs saved under ``--out``).
"""

from __future__ import annotations

import argparse
import ast
import collections
import hashlib
import json
import os
import random
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.abspath(__file__)
SHAPES = {"fc.weight": (3, 4), "fc.bias": (3,), "ln.weight": (3,), "ln.bias": (3,)}


# ----------------------------------------------------------------------------------------------
# an independent strict safetensors reader (the safetensors spec; float tensors, cast to F32)
# ----------------------------------------------------------------------------------------------
class Reject(Exception):
    pass


def _no_dupes(pairs):
    keys = [k for k, _ in pairs]
    if len(keys) != len(set(keys)):
        raise Reject(f"duplicate names {sorted(k for k in set(keys) if keys.count(k) > 1)}")
    return dict(pairs)


# Float dtypes rlx loads into float32 parameters (by casting), with their sizes in bytes.
FLOATS = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}


def _floats(dtype: str, raw: bytes) -> np.ndarray:
    if dtype == "BF16":
        return (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
    return np.frombuffer(raw, {"F32": "<f4", "F16": "<f2", "F64": "<f8"}[dtype]).astype(np.float32)


def strict_read(raw: bytes) -> dict[str, np.ndarray]:
    if len(raw) < 8:
        raise Reject("short")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > len(raw) - 8:
        raise Reject("header length past the end")
    try:
        header = json.loads(raw[8:8 + n].decode("utf-8"), object_pairs_hook=_no_dupes)
    except (UnicodeDecodeError, ValueError) as e:
        raise Reject(f"header: {e}") from None
    if not isinstance(header, dict):
        raise Reject("header is not an object")
    data = raw[8 + n:]
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise Reject("bad metadata")
    spans, out = [], {}
    for name, info in header.items():
        # (unknown extra keys are ignored, as the safetensors reference implementation does)
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
            raise Reject(f"{name}: bad entry")
        shape, offs = info["shape"], info["data_offsets"]
        if not isinstance(info["dtype"], str) or info["dtype"] not in FLOATS:
            raise Reject(f"{name}: dtype {info['dtype']!r}")
        size = FLOATS[info["dtype"]]
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise Reject(f"{name}: shape {shape!r}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs)):
            raise Reject(f"{name}: offsets {offs!r}")
        a, b = offs
        if not 0 <= a <= b <= len(data) or b - a != size * int(np.prod(shape, dtype=object)):
            raise Reject(f"{name}: offsets {offs} for shape {shape}")
        spans.append((a, b))
        out[name] = _floats(info["dtype"], data[a:b]).reshape(shape)
    pos = 0
    for a, b in sorted(spans):
        if a != pos:
            raise Reject("data not contiguous / overlapping")
        pos = b
    if pos != len(data):
        raise Reject("data not fully covered")
    return out


# ----------------------------------------------------------------------------------------------
# seeds and the structure-aware mutator
# ----------------------------------------------------------------------------------------------
def make_model():
    import rlx

    class M(rlx.nn.Module):
        def __init__(self):
            self.fc = rlx.nn.Linear(4, 3)
            self.ln = rlx.nn.LayerNorm(3)

        def __call__(self, x):
            return self.ln(self.fc(x))

    return M()


def seeds(tmpdir: str) -> list[bytes]:
    import rlx

    out = []
    for s in range(3):
        rlx.seed(s)
        m = make_model()
        path = os.path.join(tmpdir, f"seed{s}.safetensors")
        m.save(path)
        with open(path, "rb") as f:
            out.append(f.read())
        os.remove(path)
    # the same tensors with metadata and another order of the data blocks
    t = strict_read(out[0])
    names = list(reversed(list(t)))
    header, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
    for n in names:
        b = t[n].astype("<f4").tobytes()
        header[n] = {"dtype": "F32", "shape": list(t[n].shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    out.append(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    return out


INTERESTING_INTS = [0, 1, 2, 3, 4, 7, 8, 12, 47, 48, 60, 63, 64, 255, 2**16, 2**31 - 1, 2**31,
                    2**32 - 1, 2**32, 2**53, 2**60, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -1, -(2**63)]
DTYPES = ["F32", "F64", "F16", "BF16", "I32", "I64", "U8", "BOOL", "F8_E4M3", "f32", "", "F32 ", "X"]


def split_file(raw: bytes):
    if len(raw) < 8:
        return None
    (n,) = struct.unpack("<Q", raw[:8])
    if n > len(raw) - 8:
        return None
    try:
        return json.loads(raw[8:8 + n]), raw[8 + n:]
    except (UnicodeDecodeError, ValueError):
        return None


def join_file(header, data: bytes, rng: random.Random, dupe: tuple[str, str] | None = None) -> bytes:
    h = json.dumps(header).encode()
    if dupe is not None:  # JSON text with a repeated key
        name, entry = dupe
        h = h[:-1] + b", " + json.dumps(name).encode() + b": " + entry.encode() + b"}"
    hlen = len(h)
    if rng.random() < 0.1:
        hlen = rng.choice([0, hlen - 1, hlen + 1, hlen + 8, len(h) + len(data), 2**63, 2**64 - 1])
    return struct.pack("<Q", hlen & (2**64 - 1)) + h + data


def mutate_structure(raw: bytes, rng: random.Random) -> bytes:
    parts = split_file(raw)
    if parts is None or not isinstance(parts[0], dict):
        return mutate_bytes(raw, rng)
    header, data = parts
    dupe = None
    for _ in range(rng.randint(1, 3)):
        names = [k for k in header if k != "__metadata__" and isinstance(header[k], dict)]
        op = rng.randrange(12)
        name = rng.choice(names) if names else None
        entry = header.get(name) if name else None
        if op == 0 and entry and isinstance(entry.get("shape"), list):
            sh = entry["shape"]
            if sh and rng.random() < 0.7:
                sh[rng.randrange(len(sh))] = rng.choice(INTERESTING_INTS)
            else:
                sh.append(rng.choice(INTERESTING_INTS))
        elif op == 1 and entry and isinstance(entry.get("data_offsets"), list) and entry["data_offsets"]:
            offs = entry["data_offsets"]
            offs[rng.randrange(len(offs))] = rng.choice(INTERESTING_INTS + [len(data), len(data) + 4])
        elif op == 2 and entry:
            entry["dtype"] = rng.choice(DTYPES + [None, 32, ["F32"]])
        elif op == 3 and len(names) >= 2:
            a, b = rng.sample(sorted(names), 2)
            header[a]["data_offsets"], header[b]["data_offsets"] = (header[b].get("data_offsets"),
                                                                    header[a].get("data_offsets"))
        elif op == 4 and entry:
            dupe = (name, json.dumps(rng.choice([entry, {**entry, "shape": [rng.choice(INTERESTING_INTS)]}])))
        elif op == 5 and name:
            header[rng.choice(["", "fc", "fc.weight ", "x" * 300, "\u00e9", name + "."])] = header.pop(name)
        elif op == 6 and name:
            del header[name]
        elif op == 7:
            data = data[:rng.randrange(len(data) + 1)]
        elif op == 8:
            data = data + bytes(rng.randrange(256) for _ in range(rng.choice([1, 4, 12, 100])))
        elif op == 9 and entry:
            entry[rng.choice(["shape", "data_offsets", "dtype"])] = rng.choice(
                [None, "3", 3.0, [], [[1]], {"a": 1}, [1.5], [-1, 2]])
        elif op == 10:
            header["__metadata__"] = rng.choice([{"a": "b"}, {"a": 1}, [], None, "x"])
        elif op == 11 and entry and isinstance(entry.get("data_offsets"), list) and len(entry["data_offsets"]) == 2:
            a, b = entry["data_offsets"]
            if isinstance(a, int) and isinstance(b, int):
                entry["data_offsets"] = [b, a] if rng.random() < 0.5 else [a, a]
    return join_file(header, data, rng, dupe)


def mutate_bytes(raw: bytes, rng: random.Random) -> bytes:
    b = bytearray(raw)
    for _ in range(rng.randint(1, 8)):
        op = rng.randrange(5)
        if op == 0 and b:
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif op == 1 and b:
            i = rng.randrange(len(b))
            del b[i:i + rng.randint(1, 16)]
        elif op == 2:
            i = rng.randrange(len(b) + 1)
            b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        elif op == 3 and len(b) >= 8:
            b[:8] = struct.pack("<Q", rng.choice(INTERESTING_INTS) & (2**64 - 1))
        elif op == 4 and b:
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
    return bytes(b)


# ----------------------------------------------------------------------------------------------
# the target
# ----------------------------------------------------------------------------------------------
class Target:
    def __init__(self, out_dir: str, tmpdir: str):
        import rlx

        self.rlx = rlx
        self.out_dir = out_dir
        self.path = os.path.join(tmpdir, "input.safetensors")
        rlx.seed(123)
        self.model = make_model()
        # compiled: load goes through the weight store, as in real use
        self.fn = rlx.compile(lambda m, x: m(x), self.model, {"x": rlx.InputSpec((2, 4))})
        self.snapshot = {k: p.numpy().copy() for k, p in self.model.parameters().items()}
        self.execs = 0
        self.counts: collections.Counter = collections.Counter()
        self.seen: set[str] = set()

    def restore(self):
        for k, p in self.model.parameters().items():
            p.numpy()[...] = self.snapshot[k]

    def finding(self, kind: str, detail: str, data: bytes):
        self.counts[kind] += 1
        key = f"{kind}:{re.sub(r'[0-9]+', 'N', detail)[:120]}"
        if key in self.seen:
            return
        self.seen.add(key)
        os.makedirs(self.out_dir, exist_ok=True)
        name = f"{kind}-{hashlib.sha1(data).hexdigest()[:12]}"
        with open(os.path.join(self.out_dir, name + ".safetensors"), "wb") as f:
            f.write(data)
        with open(os.path.join(self.out_dir, name + ".txt"), "w") as f:
            f.write(detail + "\n")
        print(f"FINDING {kind}: {detail} -> {name}", flush=True)

    def __call__(self, data: bytes):
        self.execs += 1
        with open(self.path, "wb") as f:
            f.write(data)
        try:
            expect = strict_read(data)
            for k, shape in SHAPES.items():
                if k not in expect or expect[k].shape != shape:
                    raise Reject("does not match the model")
            if set(expect) != set(SHAPES):
                raise Reject("extra tensors")
        except Reject as r:
            expect, why = None, str(r)
        try:
            self.model.load(self.path)
        except self.rlx.CheckpointError:
            for k, p in self.model.parameters().items():
                if not np.array_equal(p.numpy(), self.snapshot[k], equal_nan=True):
                    self.finding("changed-on-error", f"{k} changed by a refused load", data)
                    self.restore()
                    break
            return
        except Exception as e:  # noqa: BLE001 - that is the finding
            self.finding("exception", f"{type(e).__module__}.{type(e).__name__}: {str(e)[:200]}", data)
            self.restore()
            return
        if expect is None:
            self.counts["lenient"] += 1
            self.finding("lenient", f"accepted a file the strict reader rejects ({why})", data)
        else:
            for k, p in self.model.parameters().items():
                if not np.array_equal(p.numpy(), expect[k], equal_nan=True):
                    self.finding("wrong-values", f"{k} differs from the file's data", data)
                    break
        self.restore()


# ----------------------------------------------------------------------------------------------
# child: atheris or the plain loop
# ----------------------------------------------------------------------------------------------
def child_atheris(args, corpus_dir: str) -> None:
    import atheris

    with atheris.instrument_imports():
        import rlx  # noqa: F401 - instrument the Python side of load

    target = Target(args.out, args.tmp)
    rng = random.Random()

    def custom_mutator(data: bytes, max_size: int, seed: int) -> bytes:
        rng.seed(seed)
        if rng.random() < 0.6:
            out = mutate_structure(data, rng)
        else:
            out = atheris.Mutate(data, max(max_size, len(data) + 64))
        return out[:max(max_size, 8)]

    def report_progress():
        if target.execs % 2000 == 0:
            print(f"#execs {target.execs} counts {dict(target.counts)}", flush=True)

    def one(data: bytes):
        target(data)
        report_progress()

    atheris.Setup([sys.argv[0], corpus_dir, f"-max_total_time={args.budget}", "-timeout=5",
                   "-rss_limit_mb=2048", f"-artifact_prefix={os.path.join(args.out, '')}",
                   "-print_final_stats=1", "-max_len=4096"], one, custom_mutator=custom_mutator)
    try:
        atheris.Fuzz()
    finally:
        print(f"#execs {target.execs} counts {dict(target.counts)}", flush=True)


def child_plain(args, corpus_dir: str) -> None:
    target = Target(args.out, args.tmp)
    corpus = []
    for name in sorted(os.listdir(corpus_dir)):
        with open(os.path.join(corpus_dir, name), "rb") as f:
            corpus.append(f.read())
    rng = random.Random(args.seed)
    deadline = time.monotonic() + args.budget
    try:
        while time.monotonic() < deadline:
            base = rng.choice(corpus)
            data = mutate_structure(base, rng) if rng.random() < 0.6 else mutate_bytes(base, rng)
            # the crash artifact, if the interpreter dies on this input
            with open(os.path.join(args.out, ".current-input"), "wb") as f:
                f.write(data)
            target(data)
            if target.execs % 2000 == 0:
                print(f"#execs {target.execs} counts {dict(target.counts)}", flush=True)
    finally:
        print(f"#execs {target.execs} counts {dict(target.counts)}", flush=True)
    os.remove(os.path.join(args.out, ".current-input"))


# ----------------------------------------------------------------------------------------------
# supervisor
# ----------------------------------------------------------------------------------------------
def supervise(args) -> int:
    os.makedirs(args.out, exist_ok=True)
    corpus_dir = os.path.join(args.out, "corpus")
    os.makedirs(corpus_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as td:
        for i, s in enumerate(seeds(td)):
            with open(os.path.join(corpus_dir, f"seed{i}"), "wb") as f:
                f.write(s)
    try:
        import atheris  # noqa: F401

        engine = "atheris" if not args.plain else "plain"
    except ImportError:
        engine = "plain"
    print(f"fuzzing rlx.nn.Module.load for {args.seconds:.0f} s with {engine}", flush=True)
    tmpdir = tempfile.mkdtemp(prefix="rlx-fuzz-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        return _supervise(args, engine, corpus_dir, tmpdir)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def _supervise(args, engine: str, corpus_dir: str, tmpdir: str) -> int:
    start = time.monotonic()
    total_execs, crashes, runs = 0, [], 0
    counts: collections.Counter = collections.Counter()
    findings: list[str] = []
    while True:
        left = args.seconds - (time.monotonic() - start)
        if left < 2:
            break
        runs += 1
        cmd = [sys.executable, HERE, "--child", engine, "--budget", str(int(left)), "--out", args.out,
               "--seed", str(args.seed + runs), "--tmp", tmpdir]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=left + 60)
        text = p.stdout + p.stderr
        execs = [int(m) for m in re.findall(r"#execs (\d+)", text)]
        lib = re.findall(r"stat::number_of_executed_units: (\d+)", text)
        run_execs = max(execs + [int(x) for x in lib] + [0])
        total_execs += run_execs
        last_counts = re.findall(r"#execs \d+ counts (\{.*\})", text)
        if last_counts:
            counts.update(ast.literal_eval(last_counts[-1]))  # a dict literal printed by the child
        findings += [ln for ln in text.splitlines() if ln.startswith("FINDING")]
        if p.returncode != 0:
            cur = os.path.join(args.out, ".current-input")
            reason = next((ln for ln in text.splitlines() if "ERROR:" in ln or "Fatal" in ln
                           or "Traceback" in ln), f"exit status {p.returncode}")
            artifact = re.findall(r"Test unit written to (\S+)", text)
            if os.path.exists(cur):
                dst = os.path.join(args.out, f"crash-{runs}.safetensors")
                os.replace(cur, dst)
                artifact.append(dst)
            crashes.append(f"{reason.strip()} ({', '.join(artifact) or 'no artifact'})")
            with open(os.path.join(args.out, f"crash-{runs}.log"), "w") as f:
                f.write(text[-20000:])
            if not artifact and run_execs == 0:
                print(text[-3000:])
                break  # the child cannot even start: do not spin
    elapsed = time.monotonic() - start
    print(f"\n== {total_execs} executions in {elapsed:.0f} s ({total_execs / max(elapsed, 1e-9):.0f}/s), "
          f"{runs} fuzzing process(es), engine {engine}")
    print(f"outcomes: {dict(counts)}")
    serious = [f for f in findings if not f.startswith("FINDING lenient")]
    lenient = [f for f in findings if f.startswith("FINDING lenient")]
    print(f"findings: {len(crashes)} crash(es)/hang(s), {len(serious)} distinct other finding(s), "
          f"{len(lenient)} distinct lenient acceptance(s)")
    for c in crashes:
        print("  CRASH", c)
    for f in serious + lenient:
        print("  " + f)
    return 1 if crashes or serious else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0, help="time budget (default 60)")
    ap.add_argument("--out", default="fuzz-findings", help="folder for the corpus and findings")
    ap.add_argument("--plain", action="store_true", help="use the built-in mutation loop, not atheris")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", choices=["atheris", "plain"], help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--tmp", default=None, help=argparse.SUPPRESS)
    args, _ = ap.parse_known_args()
    if args.child:
        corpus_dir = os.path.join(args.out, "corpus")
        (child_atheris if args.child == "atheris" else child_plain)(args, corpus_dir)
        return 0
    return supervise(args)


if __name__ == "__main__":
    sys.exit(main())
