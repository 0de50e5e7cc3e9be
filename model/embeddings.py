"""Input embeddings (tokens, image patches, video tubelets) and M-RoPE from 3-D positions.

Legend: B batch, S sequence, D model width, P patch positions in the batch, Dp patch row width,
d = head_dim / 2 rotary frequencies.
"""

from __future__ import annotations

import torch
import torch.nn as nn

IMAGE, VIDEO = 2, 3  # modality codes of tokenizers/layout.py (the model imports nothing from there)


class MultimodalEmbedding(nn.Module):
    """Token embedding, with the `<|patch|>` positions replaced by a linear embedding of their pixel
    vectors: image patches through `patch`, video tubelets through `tubelet`."""

    def __init__(self, *, vocab_size: int, dim: int, patch_dim: int, tubelet_dim: int, patch_token_id: int):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, dim)
        self.patch = nn.Linear(patch_dim, dim, bias=False)
        self.tubelet = nn.Linear(tubelet_dim, dim, bias=False)
        self.patch_token_id = patch_token_id

    def forward(self, input_ids_BS: torch.Tensor, patches_PDp: torch.Tensor, patch_kind_P: torch.Tensor) -> torch.Tensor:
        """No host sync and no data-dependent shape: every patch row is embedded by both
        projections and the one of its kind is kept (the other costs a small GEMM and keeps both
        weights in every step's graph), and the k-th `<|patch|>` position takes row k through a
        cumulative count. Batch checks that need the data are device asserts."""
        x_BSD = self.tok(input_ids_BS)
        P = patches_PDp.shape[0] if patches_PDp is not None else 0
        if self.patch_token_id < 0:
            if P:
                raise ValueError("the batch has patches but model.patch_token_id is -1: set it from omniloom_tokenizer.json")
            return x_BSD
        is_patch_T = input_ids_BS.reshape(-1) == self.patch_token_id  # row-major, as PackedBatch
        torch._assert_async(
            is_patch_T.sum() == P, "PackedBatch must give one patch row per <|patch|> token: the count of patch rows differs"
        )
        if P == 0:
            # no patches in this batch: the two projections still join the graph (empty GEMMs, an
            # exact zero), so every parameter gets a gradient each step and DDP needs no
            # find_unused_parameters search
            idle = self.patch(x_BSD.new_zeros(0, self.patch.in_features)).sum()
            idle = idle + self.tubelet(x_BSD.new_zeros(0, self.tubelet.in_features)).sum()
            return x_BSD + idle.to(x_BSD.dtype)
        need = max(self.patch.in_features, self.tubelet.in_features)
        if patches_PDp.shape[1] < need:
            raise ValueError(
                f"patch rows have {patches_PDp.shape[1]} values but need {need} (max of image {self.patch.in_features}, "
                f"video {self.tubelet.in_features}): check model.patch_dim / model.tubelet_dim against the tokenizer settings"
            )
        kind_P = patch_kind_P.to(torch.long)
        torch._assert_async(((kind_P == IMAGE) | (kind_P == VIDEO)).all(), f"patch_kind must be {IMAGE} (image) or {VIDEO} (video)")
        dt = self.patch.weight.dtype
        img_PD = self.patch(patches_PDp[:, : self.patch.in_features].to(dt))
        vid_PD = self.tubelet(patches_PDp[:, : self.tubelet.in_features].to(dt))
        emb_PD = torch.where((kind_P == IMAGE).unsqueeze(1), img_PD, vid_PD).to(x_BSD.dtype)
        row_T = (is_patch_T.cumsum(0) - 1).clamp(min=0)
        flat_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
        flat_TD = torch.where(is_patch_T.unsqueeze(1), emb_PD.index_select(0, row_T), flat_TD)
        return flat_TD.view_as(x_BSD)


def mrope_angles(positions_B3S: torch.Tensor, *, head_dim: int, sections: tuple[int, int, int], base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, S, d] in fp32 for the half-split rotary convention (kernels apply_rope).

    Frequency i (of d = head_dim / 2, fastest first) rotates with the t, h or w position according
    to `sections` (head-dim counts, halved into frequency counts): the first sections[0] / 2
    frequencies follow time, the next sections[1] / 2 rows, the rest columns (M-RoPE, Qwen2-VL).
    Text has t = h = w, so for text this is plain 1-D RoPE."""
    d = head_dim // 2
    dev = positions_B3S.device
    inv_freq_d = base ** (-torch.arange(d, device=dev, dtype=torch.float64) * 2.0 / head_dim)
    # frequency i follows axis 0, 1 or 2 by the section it falls in (arithmetic on the device:
    # no host-to-device copy, no repeat_interleave of a data-sized result)
    i_d = torch.arange(d, device=dev)
    axis_d = (i_d >= sections[0] // 2).long() + (i_d >= (sections[0] + sections[1]) // 2).long()
    pos_BSd = positions_B3S.to(torch.float64).index_select(1, axis_d).transpose(1, 2)
    ang = pos_BSd * inv_freq_d  # float64: positions up to 1e6 keep their phase exactly
    return ang.cos().float(), ang.sin().float()
