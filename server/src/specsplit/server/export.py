"""Export a Hugging Face causal LM to an ONNX draft model with explicit KV cache.

Inputs: input_ids, attention_mask, position_ids, past_key_values.{i}.key|value;
outputs: logits, present.{i}.key|value (the common convention), so the edge can run
it with ONNX Runtime alone. Before anything is written, ONNX Runtime's logits are
compared with torch's on a few prompts with a non-empty cache; an export that
disagrees by more than the tolerance is refused.
"""
from __future__ import annotations

import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from specsplit.common.export_meta import (
    INPUTS,
    INT4_BLOCK_SIZE,
    INT4_BLOCK_SIZES,
    LOGITS,
    META_FILE,
    MODEL_FILE,
    DraftExportMeta,
    past_names,
    present_names,
)
from specsplit.server.dir_swap import replace_dir
from specsplit.server.kvcache import cache_from_tensors, cache_tensors, kv_shape, output_cache
from specsplit.server.loading import LoadedModel, load_model, source_sha256

log = logging.getLogger(__name__)

# Max |logit difference|, ONNX Runtime fp32 vs torch fp32. Real 0.5B models land near
# 1e-3 (logits of magnitude ~20); a broken graph is off by whole units.
DEFAULT_TOLERANCE = 5e-3
PARITY_PROMPTS = ["def fibonacci(n):", "Hello, world! How are", "import numpy as np\nx ="]
OPSET = 17  # the ONNX opset the draft is exported at


class ExportParityError(RuntimeError):
    """ONNX Runtime and torch disagree beyond the tolerance: the export is not written."""


@dataclass(frozen=True)
class ParityReport:
    max_abs_diff: float
    top1_agreement: float  # fraction of positions whose argmax agrees


class _KVWrapper(torch.nn.Module):
    """Flat tensors in and out, so the TorchScript exporter can name every KV tensor."""

    def __init__(self, model: torch.nn.Module, num_layers: int) -> None:
        super().__init__()
        self.model = model
        self.num_layers = num_layers

    def forward(self, input_ids, attention_mask, position_ids, *past):  # type: ignore[no-untyped-def]
        cache = cache_from_tensors([(past[2 * i], past[2 * i + 1]) for i in range(self.num_layers)])
        out = self.model(input_ids, attention_mask, position_ids, cache, use_cache=True)
        flat = [t for pair in cache_tensors(output_cache(out)) for t in pair]
        return (out.logits, *flat)


def _export_graph(loaded: LoadedModel, path: Path) -> None:
    layers, kv_heads, head_dim = kv_shape(loaded.model.config)
    wrapper = _KVWrapper(loaded.model, layers).eval()
    past_len, seq = 2, 3
    inputs = (
        torch.ones((1, seq), dtype=torch.long),
        torch.ones((1, past_len + seq), dtype=torch.long),
        torch.arange(past_len, past_len + seq).unsqueeze(0),
        *[torch.zeros((1, kv_heads, past_len, head_dim)) for _ in range(2 * layers)],
    )
    ids, mask, positions = INPUTS
    past, present = past_names(layers), present_names(layers)
    dynamic = {
        ids: {0: "batch", 1: "seq"},
        mask: {0: "batch", 1: "total"},
        positions: {0: "batch", 1: "seq"},
        LOGITS: {0: "batch", 1: "seq"},
        **{n: {0: "batch", 2: "past"} for n in past},
        **{n: {0: "batch", 2: "total"} for n in present},
    }
    with torch.no_grad():
        torch.onnx.export(
            wrapper,
            inputs,
            str(path),
            input_names=[*INPUTS, *past],
            output_names=[LOGITS, *present],
            dynamic_axes=dynamic,
            opset_version=OPSET,
            dynamo=False,
        )


def _ort_step(session: ort.InferenceSession, ids: list[int], past: list[np.ndarray], past_len: int):  # type: ignore[no-untyped-def]
    feed = dict(zip(INPUTS, (
        np.asarray([ids], dtype=np.int64),
        np.ones((1, past_len + len(ids)), dtype=np.int64),
        np.arange(past_len, past_len + len(ids), dtype=np.int64)[None, :],
    )))
    feed.update(zip(past_names(len(past) // 2), past))
    logits, *present = session.run(None, feed)
    return logits[0], present


def parity_check(loaded: LoadedModel, onnx_path: Path) -> ParityReport:
    """ORT vs torch logits on each prompt: the first half fills the cache, the second
    half is decoded against it, so the KV inputs and outputs are exercised."""
    layers, kv_heads, head_dim = kv_shape(loaded.model.config)
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    worst, agree, total = 0.0, 0, 0
    for prompt in PARITY_PROMPTS:
        ids = loaded.tokenizer(prompt)["input_ids"]
        if len(ids) < 2:
            ids = ids * 2
        with torch.no_grad():
            ref = loaded.model(torch.tensor([ids])).logits[0].float().numpy()
        half = len(ids) // 2
        empty = [np.zeros((1, kv_heads, 0, head_dim), dtype=np.float32) for _ in range(2 * layers)]
        first, present = _ort_step(session, ids[:half], empty, 0)
        second, _ = _ort_step(session, ids[half:], present, half)
        got = np.concatenate([first, second])
        # np.maximum keeps a NaN (max(0.0, nan) is 0.0): NaN logits must fail the check.
        worst = float(np.maximum(worst, np.abs(got - ref).max()))
        agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
        total += len(ids)
    return ParityReport(worst, agree / total)


def int4_scheme(block_size: int) -> str:
    return f"blocks of {block_size}, asymmetric; embeddings int8"


# How each quantization stores the weights, recorded in the export's metadata so that an
# export made with an older scheme of the same name is redone (models.prepare_draft).
# int8: one scale per output channel, not one per weight matrix: a handful of outlier weights
# then stretch only their own channel's scale. For the default 0.5B draft this brought the
# int8 draft's greedy agreement with the 1.5B target from 81% to 84% (the fp32 draft's
# figure) for a tenth more time per token.
# int4: the matrices in blocks of 32 inputs by default (--int4-block-size), each block with
# its own scale and zero point (ONNX Runtime's MatMulNBits), which is how the default draft's
# GGUF (Q4_K) stores them in the first place; the embedding table int8. On the default pair it agrees with the target
# as often as int8 (83.5% against 83.6% teacher-forced over the benchmark's outputs), takes
# 14% less time a token and 21% less for the two-row steps that grow a branch, and is 445
# MB against 616 (docs/benchmarks.md).
SCHEMES = {"int8": "per-channel", "int4": int4_scheme(INT4_BLOCK_SIZE)}
QUANTIZATIONS = ("none", *SCHEMES)


def quantize_int8(src: Path, dst: Path) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8, per_channel=True,
                     use_external_data_format=False)


def quantize_int4(src: Path, dst: Path, work: Path, block_size: int = INT4_BLOCK_SIZE) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    # accuracy_level 4: the activations go to int8 inside the kernel, so the products run
    # on the CPU's integer dot-product units, as the int8 scheme's do.
    # Larger blocks store fewer scales and zero points, and the draft step, which reads every
    # weight once, reads fewer bytes (docs/benchmarks.md has the trade against agreement).
    matmuls = MatMulNBitsQuantizer(str(src), bits=4, block_size=block_size, is_symmetric=False, accuracy_level=4)
    matmuls.process()
    middle = work / "int4-matmuls.onnx"
    matmuls.model.save_model_to_file(str(middle), use_external_data_format=False)
    quantize_dynamic(str(middle), str(dst), weight_type=QuantType.QInt8, op_types_to_quantize=["Gather"],
                     use_external_data_format=False)
    middle.unlink()


def check_replaceable(out_dir: Path) -> None:
    """Raise unless `out_dir` may be written over: absent, empty, or an earlier export (it
    holds META_FILE). The export replaces the whole directory, so a mistyped --out must not
    take someone's files with it."""
    if Path.cwd().resolve().is_relative_to(out_dir.resolve()):  # "--out .": the work would go inside it
        raise FileExistsError(f"{out_dir} is the current directory or holds it: the export replaces it whole; "
                              "give another --out, or run from elsewhere")
    if out_dir.is_symlink():  # replaced whole, the link would go and its target stay
        raise FileExistsError(f"{out_dir} is a symbolic link: give the directory it points to "
                              f"({out_dir.resolve()}) or a new one")
    for parent in out_dir.absolute().parents:  # found now, not once the model has loaded
        if parent.exists():
            if not parent.is_dir():
                raise FileExistsError(f"{parent} is a file: --out {out_dir} cannot be made in it")
            break
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} is a file, not a directory for the export")
    if any(out_dir.iterdir()) and not (out_dir / META_FILE).is_file():
        raise FileExistsError(f"{out_dir} holds files but no earlier export ({META_FILE}); "
                              "give an empty or new directory, or an earlier export to replace")


def export_draft(
    model_path: str,
    out_dir: Path,
    quantize: str = "none",
    tolerance: float = DEFAULT_TOLERANCE,
    int4_block_size: int = INT4_BLOCK_SIZE,
) -> DraftExportMeta:
    """Export, check parity, optionally quantize, and write `out_dir` atomically."""
    if quantize not in QUANTIZATIONS:
        raise ValueError(f"quantize must be one of {QUANTIZATIONS}, got {quantize!r}")
    if int4_block_size not in INT4_BLOCK_SIZES:
        raise ValueError(f"int4 block size must be one of {INT4_BLOCK_SIZES}, got {int4_block_size!r}")
    scheme = int4_scheme(int4_block_size) if quantize == "int4" else SCHEMES.get(quantize)
    out_dir = Path(out_dir)
    check_replaceable(out_dir)
    log.info("loading %s", model_path)
    loaded = load_model(model_path, dtype="fp32", attn="eager", rows_invariant=False)  # PyTorch's own layers trace
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=f".{out_dir.name}.") as tmp:
        work = Path(tmp)
        fp32 = work / "fp32" / MODEL_FILE
        fp32.parent.mkdir()
        log.info("exporting to ONNX (opset %d)", OPSET)
        _export_graph(loaded, fp32)
        report = parity_check(loaded, fp32)
        log.info("parity: max |logit diff| %.2e, top-1 agreement %.3f", report.max_abs_diff, report.top1_agreement)
        if not report.max_abs_diff <= tolerance:
            raise ExportParityError(
                f"ONNX Runtime logits differ from torch by {report.max_abs_diff:.3e} "
                f"(tolerance {tolerance:.1e}); refusing to write {out_dir}"
            )
        final = work / "final"
        final.mkdir()
        extra = {}
        if quantize != "none":
            log.info("quantizing weights to %s (%s)", quantize, scheme)
            if quantize == "int8":
                quantize_int8(fp32, final / MODEL_FILE)
            else:
                quantize_int4(fp32, final / MODEL_FILE, work, int4_block_size)
            q = parity_check(loaded, final / MODEL_FILE)
            log.info("%s: max |logit diff| %.2e, top-1 agreement %.3f", quantize, q.max_abs_diff, q.top1_agreement)
            # Quantized logits differ by design (no tolerance holds them), but never to NaN or infinity.
            if not np.isfinite(q.max_abs_diff):
                raise ExportParityError(f"the {quantize} graph's logits are not finite ({q.max_abs_diff}); "
                                        f"refusing to write {out_dir}")
            extra = {f"{quantize}_scheme": scheme, f"{quantize}_max_abs_logit_diff": q.max_abs_diff,
                     f"{quantize}_top1_agreement": q.top1_agreement}
        else:
            for f in fp32.parent.iterdir():
                shutil.move(str(f), final / f.name)
        loaded.tokenizer.save_pretrained(final)
        layers, kv_heads, head_dim = kv_shape(loaded.model.config)
        meta = DraftExportMeta(
            num_layers=layers,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=loaded.model.config.vocab_size,
            eos_ids=loaded.eos_ids,
            tokenizer_fingerprint=loaded.fingerprint,
            source_model=model_path,
            source_sha256=source_sha256(model_path),
            quantization=quantize,
            max_abs_logit_diff=report.max_abs_diff,
            extra=extra,
        )
        meta.save(final)
        replace_dir(final, out_dir)
    return meta
