"""SparseLoCo's deployed recipe (tplr-ai/templar), re-implemented independently in float64
numpy, with loops where the reference relies on a library's semantics: the oracle of
tests/test_sparseloco.py and scripts/sparseloco_effects.py.

Each round runs what `prepare_gradient_dict` does per worker (error feedback e ← β·e + lr·Δ,
`ChunkingTransformer.encode` without DCT, `TopKCompressor.compress` with its 4-bin statistical
quantisation, `decompress`, `decode`, e ← e − transmitted) and what `outer_step` does
(`batch_decompress` with the median norm clip and `scatter_reduce(mean, include_self=False)`,
`decode`, then SGD at lr).
"""

import math

import numpy as np



def ref_split(n: int, close_to: int) -> int:
    """`_get_smaller_split`: walk n's divisors upwards, stop at close_to or just below it."""
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    for index, value in enumerate(divisors):
        if value == close_to:
            return value
        if value > close_to:
            return value if index == 0 else divisors[index - 1]
    return n


def ref_chunks(x: np.ndarray, target: int) -> tuple[np.ndarray, tuple]:
    """`encode` then `compress`'s rearrange: rows of chunks, chunk (y, x) entry i·w + j = X[y·h + i, x·w + j]."""
    if x.ndim == 1:
        w = ref_split(x.shape[0], target)
        return np.array([[x[c * w + j] for j in range(w)] for c in range(x.shape[0] // w)]), (1, w)
    h, w = ref_split(x.shape[0], target), ref_split(x.shape[1], target)
    rows = []
    for y in range(x.shape[0] // h):
        for col in range(x.shape[1] // w):
            rows.append([x[y * h + i, col * w + j] for i in range(h) for j in range(w)])
    return np.array(rows), (h, w)


def ref_unchunk(chunks: np.ndarray, shape: tuple, tile: tuple) -> np.ndarray:
    """`decode`: the inverse rearrange."""
    h, w = tile
    out = np.zeros(shape)
    if len(shape) == 1:
        return chunks.reshape(-1)
    per_row = shape[1] // w
    for c, row in enumerate(chunks):
        y, col = divmod(c, per_row)
        for e, value in enumerate(row):
            i, j = divmod(e, w)
            out[y * h + i, col * w + j] = value
    return out


def ref_clamp_topk(topk: int, total: int) -> int:
    topk = max(min(topk, total), 2)
    return topk - topk % 2


def ref_quantize(val: np.ndarray, bins: int = 4, sigmas: int = 6) -> np.ndarray:
    """`_quantize_values` and `_dequantize_values`: what the receiver decodes."""
    shift = val.mean()
    centered = val - shift
    scale = sigmas * (np.linalg.norm(centered) / math.sqrt(centered.size - 1)) / bins
    if scale == 0 or not np.isfinite(scale):
        scale = 1.0
    codes = np.clip(np.round(centered / scale + bins // 2), 0, bins - 1).astype(int)  # round half to even
    lookup = [centered[codes == b].mean() if (codes == b).any() else 0.0 for b in range(bins)]
    return np.array([lookup[c] for c in codes.reshape(-1)]).reshape(val.shape) + shift


def ref_compress(e: np.ndarray, target: int, topk: int) -> tuple[np.ndarray, np.ndarray, tuple]:
    """(indices, dequantized values) per chunk, and the tile."""
    chunks, tile = ref_chunks(e, target)
    k = ref_clamp_topk(topk, chunks.shape[1])
    idx = np.argsort(-np.abs(chunks), axis=1, kind="stable")[:, :k]
    val = np.take_along_axis(chunks, idx, axis=1)
    return idx, ref_quantize(val), tile


def ref_scatter_mean(shape: tuple, pieces: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """`scatter_reduce_(reduce="mean", include_self=False)` into zeros over the concatenated pieces."""
    sent: dict[tuple[int, int], list[float]] = {}
    for idx, val in pieces:
        for c in range(idx.shape[0]):
            for i, v in zip(idx[c], val[c]):
                sent.setdefault((c, int(i)), []).append(v)
    out = np.zeros(shape)
    for (c, i), values in sent.items():
        out[c, i] = sum(values) / len(values)
    return out


def ref_round(theta, errors, deltas, target, topk, decay, lr, arrived):
    """One round of the deployed recipe for every tensor: each arrived worker's error feedback
    and compression, then the clipped mean and the SGD step. Updates `errors`, returns θ."""
    new_theta = {}
    for name, param in theta.items():
        sent = []
        for worker in arrived:
            e = errors[worker][name] * decay + lr * deltas[worker][name]
            idx, val, tile = ref_compress(e, target, topk)
            chunks_shape = ref_chunks(e, target)[0].shape
            errors[worker][name] = e - ref_unchunk(ref_scatter_mean(chunks_shape, [(idx, val)]), e.shape, tile)
            sent.append((idx, val))
        norms = np.array([np.linalg.norm(val) for _, val in sent])
        median = np.sort(norms)[(len(norms) - 1) // 2]  # torch.median: the lower of the two middle ones
        clipped = [(idx, val * min(median / (norm + 1e-8), 1.0)) for (idx, val), norm in zip(sent, norms)]
        chunks_shape = ref_chunks(param, target)[0].shape
        grad = ref_unchunk(ref_scatter_mean(chunks_shape, clipped), param.shape, tile)
        new_theta[name] = param - lr * grad
    return new_theta
