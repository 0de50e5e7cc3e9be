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
        x_BSD = self.tok(input_ids_BS)
        P = patches_PDp.shape[0] if patches_PDp is not None else 0
        if self.patch_token_id < 0:
            if P:
                raise ValueError("the batch has patches but model.patch_token_id is -1: set it from omniloom_tokenizer.json")
            return x_BSD
        where_P = (input_ids_BS.reshape(-1) == self.patch_token_id).nonzero().squeeze(1)  # row-major, as PackedBatch
        if where_P.numel() != P:
            raise ValueError(f"batch has {where_P.numel()} <|patch|> tokens but {P} patch rows; PackedBatch must give one row per <|patch|>")
        if P == 0:
            return x_BSD
        kind_P = patch_kind_P.to(torch.long)
        emb_PD = torch.zeros(P, x_BSD.shape[-1], dtype=x_BSD.dtype, device=x_BSD.device)
        for code, proj in ((IMAGE, self.patch), (VIDEO, self.tubelet)):
            rows = (kind_P == code).nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            if patches_PDp.shape[1] < proj.in_features:
                raise ValueError(
                    f"patch rows have {patches_PDp.shape[1]} values but {'image' if code == IMAGE else 'video'} "
                    f"patches need {proj.in_features}: check model.patch_dim / model.tubelet_dim against omniloom_tokenizer.json"
                )
            vec = patches_PDp.index_select(0, rows)[:, : proj.in_features].to(proj.weight.dtype)
            emb_PD = emb_PD.index_copy(0, rows, proj(vec).to(emb_PD.dtype))
        unknown = ~((kind_P == IMAGE) | (kind_P == VIDEO))
        if bool(unknown.any()):
            raise ValueError(f"patch_kind must be {IMAGE} (image) or {VIDEO} (video); got {sorted(set(kind_P[unknown].tolist()))}")
        flat_TD = x_BSD.reshape(-1, x_BSD.shape[-1]).index_copy(0, where_P, emb_PD)
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
    axis_d = torch.repeat_interleave(torch.arange(3, device=dev), torch.tensor([s // 2 for s in sections], device=dev))
    pos_BSd = positions_B3S.to(torch.float64).index_select(1, axis_d).transpose(1, 2)
    ang = pos_BSd * inv_freq_d  # float64: positions up to 1e6 keep their phase exactly
    return ang.cos().float(), ang.sin().float()
