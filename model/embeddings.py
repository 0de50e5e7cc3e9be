"""Input embeddings (tokens, image patches, video tubelets) and M-RoPE from 3-D positions.

Legend: B batch, S sequence, D model width, P patch positions in the batch, Dp patch row width,
d = head_dim / 2 rotary frequencies.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import CONV_STEM_WIDTH, ROPE_LAYOUTS, conv_stem_features, patch_side

IMAGE, VIDEO = 2, 3  # modality codes of tokenizers/layout.py (the model imports nothing from there)


_CPU_ROW_SELECTION = [True]


def data_dependent_shapes_are_free(t: torch.Tensor) -> bool:
    """Whether work may be cut to the rows that need it (boolean selection, `nonzero`): on the
    CPU a data-dependent shape costs no host sync and the rows it skips are time saved; on an
    accelerator, and inside torch.compile, every step keeps fixed shapes and no sync."""
    return _CPU_ROW_SELECTION[0] and t.device.type == "cpu" and not torch.compiler.is_compiling()


@contextlib.contextmanager
def accelerator_shapes():
    """Run the CPU as an accelerator would (fixed shapes, no sync): how tests check the
    accelerator's path, and its equality with the CPU's row selection, on a CPU."""
    before = _CPU_ROW_SELECTION[0]
    _CPU_ROW_SELECTION[0] = False
    try:
        yield
    finally:
        _CPU_ROW_SELECTION[0] = before


class ConvStem(nn.Module):
    """Two 3x3 stride-2 convolutions with GELU over one patch's pixels, flattened: the
    early-convolution stem (Xiao et al. 2021) run inside each patch. A row of the patch matrix
    is (channels x frames, p, p) in that order (tokenizers/image.py), so frames become channels."""

    def __init__(self, in_channels: int, p: int, width: int = CONV_STEM_WIDTH):
        super().__init__()
        self.in_channels, self.p = in_channels, p
        self.conv1 = nn.Conv2d(in_channels, width, 3, stride=2, padding=1, bias=False)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, bias=False)
        self.out_features = conv_stem_features(p, width)

    def forward(self, x_PD: torch.Tensor) -> torch.Tensor:
        # The convolutions run channels-last (oneDNN's CPU kernels and cuDNN's tensor-core ones
        # are NHWC-native); the last GELU runs on the (channel, y, x) order that flatten reads
        # (its backward on channels-last strides against a contiguous gradient was 2.5x slower).
        # Forward + backward on 1,100 patches, one CPU thread: 1.39x all-NCHW's speed
        # (`omniloom bench model` part 3).
        x = x_PD.reshape(-1, self.in_channels, self.p, self.p).contiguous(memory_format=torch.channels_last)
        return F.gelu(self.conv2(F.gelu(self.conv1(x))).contiguous()).flatten(1)


class MultimodalEmbedding(nn.Module):
    """Token embedding, with the `<|patch|>` positions replaced by a linear embedding of their pixel
    vectors: image patches through `patch`, video tubelets through `tubelet` (with
    `patch_stem="conv"`, of a ConvStem's features of the pixels instead: a tubelet's own stem
    with its frames as input channels, or with `conv_stem_video="frames"` the image stem's
    features of each of its frames).

    `visual_pos_max > 0` adds factorised learned absolute positions to every patch embedding
    (NaViT / AIMv2 style): `pos_t[ti] + pos_h[hi] + pos_w[wi]`, the patch's time, row and column
    within its block (coordinates past `visual_pos_max - 1` share the last entry)."""

    def __init__(self, *, vocab_size: int, dim: int, patch_dim: int, tubelet_dim: int, patch_token_id: int,
                 visual_pos_max: int = 0, patch_stem: str = "linear", conv_stem_width: int = CONV_STEM_WIDTH,
                 conv_stem_video: str = "channels", visual_dim: int = 0):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, dim)
        # the stem's output width: the decoder's, or a vision encoder's (model/vision_encoder.py)
        self.visual_dim = visual_dim = visual_dim or dim
        self.patch_in, self.tubelet_in = patch_dim, tubelet_dim
        self.frames_per_tubelet = tubelet_dim // patch_dim
        self.frames_through_image_stem = False
        if patch_stem == "conv":
            p = patch_side(patch_dim)
            self.patch_stem = ConvStem(3, p, conv_stem_width)
            if conv_stem_video == "frames":
                # each frame of a tubelet through the image stem (the same weights): clips and
                # images teach one stem; the projection reads the frames' features side by side
                self.frames_through_image_stem = True
                self.tubelet_stem = None
                patch_dim, tubelet_dim = self.patch_stem.out_features, self.frames_per_tubelet * self.patch_stem.out_features
            else:
                self.tubelet_stem = ConvStem(3 * self.frames_per_tubelet, p, conv_stem_width)
                patch_dim, tubelet_dim = self.patch_stem.out_features, self.tubelet_stem.out_features
        else:
            self.patch_stem = self.tubelet_stem = None
        self.patch = nn.Linear(patch_dim, visual_dim, bias=False)
        self.tubelet = nn.Linear(tubelet_dim, visual_dim, bias=False)
        self.patch_token_id = patch_token_id
        self.visual_pos_max = visual_pos_max
        if visual_pos_max:
            self.pos_t = nn.Embedding(visual_pos_max, dim)
            self.pos_h = nn.Embedding(visual_pos_max, dim)
            self.pos_w = nn.Embedding(visual_pos_max, dim)

    def forward(self, input_ids_BS: torch.Tensor, patches_PDp: torch.Tensor, patch_kind_P: torch.Tensor,
                positions_B3S: torch.Tensor | None = None, encode=None) -> torch.Tensor:
        """No host sync and no data-dependent shape on an accelerator: every patch row is embedded
        by both projections and the one of its kind is kept (the other costs a small GEMM and keeps
        both weights in every step's graph); on the CPU each row goes through its own kind's
        projection only (`data_dependent_shapes_are_free`; an empty selection still puts the
        other projection in the graph). The k-th `<|patch|>` position takes row k through a
        cumulative count. Batch checks that need the data are device asserts. `positions_B3S`
        is needed only with learned visual positions (`visual_pos_max > 0`). `encode`: late
        fusion, a function from the stem's embeddings of the patch rows [P, visual_dim] to the
        decoder's [P, D] (OmniModel.embed_inputs: the vision encoder); with no patch rows it runs
        on none (its parameters join the graph) when gradients are on, and not at all otherwise."""
        x_BSD = self.tok(input_ids_BS)
        P = patches_PDp.shape[0] if patches_PDp is not None else 0
        if self.patch_token_id < 0:
            if P:
                raise ValueError("the batch has patches but model.patch_token_id is -1: set it from omniloom_tokenizer.json")
            return x_BSD
        is_patch_BS = input_ids_BS == self.patch_token_id
        is_patch_T = is_patch_BS.reshape(-1)  # row-major, as PackedBatch
        torch._assert_async(
            is_patch_T.sum() == P, "PackedBatch must give one patch row per <|patch|> token: the count of patch rows differs"
        )
        if P == 0:
            # no patches in this batch: the projections still join the graph (empty GEMMs, an
            # exact zero), so every parameter gets a gradient each step and DDP needs no
            # find_unused_parameters search
            idle = self._image(x_BSD.new_zeros(0, self.patch_in)).sum()
            idle = idle + self._video(x_BSD.new_zeros(0, self.tubelet_in)).sum()
            if self.visual_pos_max:
                none = input_ids_BS.new_zeros(0)
                idle = idle + (self.pos_t(none).sum() + self.pos_h(none).sum() + self.pos_w(none).sum())
            if encode is not None and torch.is_grad_enabled():
                idle = idle + encode(x_BSD.new_zeros(0, self.visual_dim)).sum()
            return x_BSD + idle.to(x_BSD.dtype)
        need = max(self.patch_in, self.tubelet_in)
        if patches_PDp.shape[1] < need:
            raise ValueError(
                f"patch rows have {patches_PDp.shape[1]} values but need {need} (max of image {self.patch_in}, "
                f"video {self.tubelet_in}): check model.patch_dim / model.tubelet_dim against the tokenizer settings"
            )
        kind_P = patch_kind_P.to(torch.long)
        torch._assert_async(((kind_P == IMAGE) | (kind_P == VIDEO)).all(), f"patch_kind must be {IMAGE} (image) or {VIDEO} (video)")
        dt = self.patch.weight.dtype
        if data_dependent_shapes_are_free(patches_PDp):
            # each row through its own kind's projection only (half the stem and projection work)
            img_P = (kind_P == IMAGE).nonzero().squeeze(1)
            vid_P = (kind_P != IMAGE).nonzero().squeeze(1)
            img_ID = self._image(patches_PDp.index_select(0, img_P)[:, : self.patch_in].to(dt)).to(x_BSD.dtype)
            vid_VD = self._video(patches_PDp.index_select(0, vid_P)[:, : self.tubelet_in].to(dt)).to(x_BSD.dtype)
            emb_PD = img_ID.new_zeros(P, img_ID.shape[1]).index_copy(0, img_P, img_ID).index_copy(0, vid_P, vid_VD)
        else:
            img_PD = self._image(patches_PDp[:, : self.patch_in].to(dt))
            vid_PD = self._video(patches_PDp[:, : self.tubelet_in].to(dt))
            emb_PD = torch.where((kind_P == IMAGE).unsqueeze(1), img_PD, vid_PD).to(x_BSD.dtype)
        if encode is not None:
            emb_PD = encode(emb_PD).to(x_BSD.dtype)
        row_T = (is_patch_T.cumsum(0) - 1).clamp(min=0)
        emb_TD = emb_PD.index_select(0, row_T)
        if self.visual_pos_max:
            if positions_B3S is None:
                raise ValueError("learned visual positions (model.visual_pos_max > 0) need the batch's positions")
            emb_TD = emb_TD + self._grid_embedding(is_patch_BS, positions_B3S).to(emb_TD.dtype)
        flat_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
        flat_TD = torch.where(is_patch_T.unsqueeze(1), emb_TD, flat_TD)
        return flat_TD.view_as(x_BSD)

    def _image(self, x_PD: torch.Tensor) -> torch.Tensor:
        return self.patch(self.patch_stem(x_PD) if self.patch_stem is not None else x_PD)

    def _video(self, x_PD: torch.Tensor) -> torch.Tensor:
        if self.frames_through_image_stem:
            # a tubelet row is (channel, frame, y, x) (tokenizers/image.py): frames out, each an
            # image patch row (channel, y, x), their features back side by side in frame order
            P, tp, p = x_PD.shape[0], self.frames_per_tubelet, self.patch_stem.p
            frames_FD = x_PD.reshape(P, 3, tp, p * p).transpose(1, 2).reshape(P * tp, 3 * p * p)
            return self.tubelet(self.patch_stem(frames_FD).reshape(P, tp * self.patch_stem.out_features))
        return self.tubelet(self.tubelet_stem(x_PD) if self.tubelet_stem is not None else x_PD)

    def _grid_embedding(self, is_patch_BS: torch.Tensor, positions_B3S: torch.Tensor) -> torch.Tensor:
        """pos_t + pos_h + pos_w of every token's (time, row, column) within its visual block [B*S, D]
        (meaningless, and masked out by the caller, at other tokens). A block is a run of
        `<|patch|>` tokens (its tags separate it from the next), whose first patch sits at the
        block's origin (p, p, p), so a patch's grid coordinates are its positions minus those of
        its run's first token: found by a running max of run starts, on the device."""
        B, S = is_patch_BS.shape
        prev_BS = torch.cat([is_patch_BS.new_zeros(B, 1), is_patch_BS[:, :-1]], dim=1)
        starts_BS = is_patch_BS & ~prev_BS
        idx_BS = torch.arange(S, device=is_patch_BS.device).expand(B, S)
        first_BS = torch.where(starts_BS, idx_BS, torch.zeros_like(idx_BS)).cummax(dim=1).values
        pos_B3S = positions_B3S.to(torch.long)
        origin_B3S = pos_B3S.gather(2, first_BS.unsqueeze(1).expand(B, 3, S))
        grid_B3S = (pos_B3S - origin_B3S).clamp(0, self.visual_pos_max - 1)
        g = grid_B3S.permute(1, 0, 2).reshape(3, B * S)
        return self.pos_t(g[0]) + self.pos_h(g[1]) + self.pos_w(g[2])


def rope_axes(num_freqs: int, counts: tuple[int, int, int], layout: str) -> list[int]:
    """The position axis (0 time, 1 row, 2 column) that rotary frequency i follows, for i in
    0..num_freqs-1 ordered fastest first; `counts` frequencies per axis (summing to num_freqs).

    `sections` (Qwen2-VL's M-RoPE): the first counts[0] frequencies, the fastest, follow time, the
    next counts[1] rows, the last, the slowest, columns. With raw patches this leaves columns
    only frequencies too slow to tell neighbours apart (a column step turns them by ~1e-3 rad at
    head dim 32), so models trained this way cannot see left from right.
    `interleaved` (as Qwen3-VL's interleaved M-RoPE): the axes take turns, each frequency going to
    the axis furthest behind its share counts[a] / num_freqs so far (ties: t, h, w), so every
    axis holds frequencies spread over the whole range, fast ones and slow ones; with equal
    counts this is t h w t h w ...
    Text has t = h = w, so for text every layout is plain 1-D RoPE."""
    if sum(counts) != num_freqs or min(counts) < 0:
        raise ValueError(f"rotary counts {counts} must be >= 0 and sum to {num_freqs}")
    if layout == "sections":
        return [0] * counts[0] + [1] * counts[1] + [2] * counts[2]
    if layout not in ROPE_LAYOUTS:
        raise ValueError(f"model.rope_layout={layout!r}: choose one of {', '.join(ROPE_LAYOUTS)}")
    given = [0, 0, 0]
    axes: list[int] = []
    for i in range(num_freqs):
        # integer deficit (scaled by num_freqs): counts[a] * (i + 1) - given[a] * num_freqs
        a = max((a for a in range(3) if given[a] < counts[a]), key=lambda a: (counts[a] * (i + 1) - given[a] * num_freqs, -a))
        axes.append(a)
        given[a] += 1
    return axes


@functools.lru_cache(maxsize=64)
def _axis_table(num_freqs: int, counts: tuple[int, int, int], layout: str, device: torch.device) -> torch.Tensor:
    """`rope_axes` as a long tensor on `device`, made once per process and device (one small copy
    to the device then, none per step)."""
    return torch.tensor(rope_axes(num_freqs, counts, layout), dtype=torch.long, device=device)


def mrope_angles(positions_B3S: torch.Tensor, *, head_dim: int, sections: tuple[int, int, int], base: float,
                 layout: str = "sections") -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, S, d] in fp32 for the half-split rotary convention (kernels apply_rope).

    Frequency i (of d = head_dim / 2, fastest first, base ** (-2i / head_dim)) rotates with the
    t, h or w position that `rope_axes(d, sections / 2, layout)` gives it (`sections`: head-dim
    counts per axis, halved into frequency counts). Text has t = h = w, so for text this is
    plain 1-D RoPE whatever the layout."""
    d = head_dim // 2
    dev = positions_B3S.device
    inv_freq_d = base ** (-torch.arange(d, device=dev, dtype=torch.float64) * 2.0 / head_dim)
    axis_d = _axis_table(d, tuple(s // 2 for s in sections), layout, dev)
    pos_BSd = positions_B3S.to(torch.float64).index_select(1, axis_d).transpose(1, 2)
    ang = pos_BSd * inv_freq_d  # float64: positions up to 1e6 keep their phase exactly
    return ang.cos().float(), ang.sin().float()
