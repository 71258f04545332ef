"""What the examples share: where they run, and how they report an error against a check."""

import torch


def where_to_run() -> tuple[str, str, str]:
    """(device, backend, what): mate's native kernels on a Hopper GPU (sm90), else the PyTorch reference on the CPU."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        return "cuda", "tilelang", f"native TileLang kernels on {torch.cuda.get_device_name()}"
    why = f"{torch.cuda.get_device_name()} is not a Hopper GPU" if torch.cuda.is_available() else "no CUDA GPU"
    return "cpu", "reference", f"the PyTorch reference on the CPU ({why}; mate's native target is sm90)"


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| over the finite entries of `want`; inf if the -inf pattern or a NaN differs."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if torch.isnan(got).any() or not torch.equal(torch.isinf(got), torch.isinf(want)):
        return float("inf")
    fin = torch.isfinite(want)
    return ((got[fin] - want[fin]).norm() / want[fin].norm().clamp_min(1e-30)).item()


def report(what: str, got: torch.Tensor, want: torch.Tensor, against: str, tol: float) -> float:
    """Print the relative error of `got` against `want` and raise if it is over `tol` (a failed check fails the run)."""
    err = rel_error(got, want)
    print(f"  {what}: relative error {err:.1e} against {against} ({'ok' if err <= tol else 'FAILED'}, tolerance {tol:.0e})")
    if not err <= tol:
        raise SystemExit(f"{what}: relative error {err:.2e} over {tol:.0e}")
    return err


# ---------------------------------------------------------------- naive QSA math (float64, one row at a time)


def naive_relu_scores(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The indexer's score of each key: sum over heads of relu(q . k) / sqrt(D); q [H, D], keys [n, D]."""
    return (q.double() @ keys.double().T).clamp_min(0).sum(0) / q.shape[-1] ** 0.5


def naive_sparse_attention(q, key, value, pages, tokens, visible, gate=None):
    """One row of QSA attention: softmax(q . k / sqrt(D)) . v over the listed tokens (duplicates count once each).

    q [HQ, D]; key/value [pages, page_size, HKV, D]; pages: the request's page table row;
    tokens: the row's token ids; visible(ids) -> bool mask of those it may use; gate [HQ] or None.
    """
    ids = tokens[(tokens >= 0)].long()
    ids = ids[visible(ids)]
    page_size, hkv = key.shape[1], key.shape[2]
    page = pages.long()[ids // page_size]
    k, v = key[page, ids % page_size].double(), value[page, ids % page_size].double()  # [n, HKV, D]
    group = q.shape[0] // hkv
    out = torch.stack([torch.softmax(k[:, h // group] @ q[h].double() / q.shape[-1] ** 0.5, 0) @ v[:, h // group]
                       for h in range(q.shape[0])])
    return out if gate is None else out * torch.sigmoid(gate.double())[:, None]
