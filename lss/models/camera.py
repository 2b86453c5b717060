"""Camera encoder: EfficientNet-B0 (or ResNet-18) trunk -> fused stride-16 (or 8) features ->
per-pixel depth distribution and context."""

from __future__ import annotations

import pickle
import urllib.parse
from pathlib import Path
from typing import Optional, Sequence

import torch
from efficientnet_pytorch import EfficientNet
from efficientnet_pytorch.utils import Conv2dDynamicSamePadding, Conv2dStaticSamePadding
from torch import nn
from torch.nn import functional as F
from torchvision.models import resnet18

from lss.errors import ConfigError
from lss.geometry.camera import pixel_lut
from lss.models.blocks import Up
from lss.ops import kernels_take
from lss.ops.depthwise_conv import MAX_KERNEL, depthwise_conv2d

# model.pretrained's value for efficientnet-pytorch's own ImageNet weights (torch.hub's cache)
IMAGENET = "imagenet"


def load_imagenet_from_hub(net: nn.Module, name: str) -> None:
    """Load efficientnet-pytorch's ImageNet weights of `name` into the whole network `net` through
    the library's loader, which reads torch.hub's cache and downloads the file there when it is
    missing. Offline with no cached copy: a ConfigError that says where to put the file or how to
    pass its path."""
    from efficientnet_pytorch import utils

    url = utils.url_map[name]
    cached = Path(torch.hub.get_dir()) / "checkpoints" / Path(urllib.parse.urlparse(url).path).name
    try:
        utils.load_pretrained_weights(net, name, load_fc=True, verbose=False)
    except OSError as e:  # urllib's URLError (no network, no such file) is an OSError
        raise ConfigError(
            f"model.pretrained=imagenet: the {name} ImageNet weights are not in torch.hub's cache "
            f"({cached}) and could not be downloaded from {url} ({e}). Download that file and "
            f"pass its path (model.pretrained=/path/to/{cached.name}), or copy it to {cached}"
        ) from None
    except (RuntimeError, AssertionError, pickle.UnpicklingError) as e:  # a damaged or foreign file
        raise ConfigError(
            f"model.pretrained=imagenet: {cached} is not the {name} ImageNet state dict ({e}); "
            "delete it so that it is downloaded again, or pass a local file's path"
        ) from None


# Modules of the classification network that the encoder never runs (dropping them keeps DDP free of
# unused params).
_UNUSED_TRUNK_MODULES = ("_conv_head", "_bn1", "_avg_pooling", "_dropout", "_fc")


class EfficientNetTrunk(nn.Module):
    """EfficientNet-B0 (model.backbone, checked when the config loads) up to its last block; returns
    the stride-16 and stride-32 feature maps.

    forward(images B x 3 x H x W) -> (B x 112 x H/16 x W/16, B x 320 x H/32 x W/32).
    """

    stride16_channels = 112
    stride32_channels = 320

    def __init__(self, name: str = "efficientnet-b0", pretrained: Optional[str] = None):
        super().__init__()
        net = EfficientNet.from_name(name)
        if pretrained == IMAGENET:
            load_imagenet_from_hub(net, name)
        net.set_swish(
            memory_efficient=False
        )  # plain x*sigmoid(x): traceable by torch.compile and ONNX export
        for attr in _UNUSED_TRUNK_MODULES:
            delattr(net, attr)
        self.net = net
        if pretrained and pretrained != IMAGENET:
            self.load_imagenet(pretrained)

    def load_imagenet(self, path: str) -> None:
        """Load ImageNet weights saved by efficientnet-pytorch from a local state dict file."""
        file = Path(path)
        if not file.is_file():
            raise FileNotFoundError(
                f"model.pretrained={path!r} does not exist; set it to imagenet (efficientnet-"
                "pytorch's weights, downloaded once into torch.hub's cache), to a local "
                "efficientnet-b0 state dict (efficientnet-b0-355c32eb.pth), or to null"
            )
        state = torch.load(file, map_location="cpu", weights_only=True)
        state = {k: v for k, v in state.items() if k.split(".")[0] not in _UNUSED_TRUNK_MODULES}
        missing, unexpected = self.net.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ConfigError(
                f"model.pretrained={path!r} is not an efficientnet-b0 state dict: missing "
                f"{missing[:5]}, unexpected {unexpected[:5]}"
            )

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        net = self.net
        x = net._swish(net._bn0(net._conv_stem(images)))
        stride16 = None
        num_blocks = len(net._blocks)
        for idx, block in enumerate(net._blocks):
            drop_rate = net._global_params.drop_connect_rate * idx / num_blocks
            y = block(x, drop_connect_rate=drop_rate)
            if y.shape[-2:] != x.shape[-2:]:
                # overwritten at every reduction: ends as the map before the last one
                # (16 -> 32)
                stride16 = x
            x = y
        if stride16 is None:
            raise ValueError(
                f"EfficientNetTrunk: input {tuple(images.shape)} is too small (needs H, W >= 32)"
            )
        return stride16, x


def same_padding(size, kernel, stride) -> tuple[int, int, int, int]:
    """TensorFlow's "same" padding (top, bottom, left, right) of an H x W input for a KH x KW
    filter at stride (sH, sW), as efficientnet-pytorch computes it: the output is ceil(size /
    stride), and an odd padding puts the extra row / column at the bottom / right."""
    (ih, iw), (kh, kw), (sh, sw) = size, kernel, stride
    pad_h = max((-(-ih // sh) - 1) * sh + kh - ih, 0)
    pad_w = max((-(-iw // sw) - 1) * sw + kw - iw, 0)
    return (pad_h // 2, pad_h - pad_h // 2, pad_w // 2, pad_w - pad_w // 2)


class _LssDepthwise:
    """Forward of efficientnet-pytorch's depthwise convolutions with TensorFlow's "same" padding
    (one row and column more at the bottom and right where the padding is odd) through
    lss.ops.depthwise_conv2d: the padding goes to the kernel instead of a padded copy of the input.
    Contiguous inputs with the compiled kernels for their device; anything else (channels-last, no
    extension, a trace for export) runs efficientnet-pytorch's own forward; so do CPU inputs unless
    `on_cpu` (lss's CPU kernels are the exact reference, slower than PyTorch's). Parameters and
    state dict stay the module's."""

    on_cpu = True

    def _padding(self, x: torch.Tensor) -> tuple[int, int, int, int]:
        raise NotImplementedError

    def _ours(self, x: torch.Tensor) -> bool:
        return (
            x.dim() == 4
            and kernels_take(x, self.on_cpu)
            and x.is_contiguous()
            and (x.dtype == self.weight.dtype or self.weight.dtype == torch.float32)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._ours(x):
            return super().forward(x)
        if torch.is_autocast_enabled(x.device.type) and x.dtype == torch.float32:
            x = x.to(torch.get_autocast_dtype(x.device.type))  # what autocast gives conv2d
        return depthwise_conv2d(x, self.weight, self.bias, tuple(self.stride), self._padding(x))


class SameDepthwiseConv2d(_LssDepthwise, Conv2dDynamicSamePadding):
    """Conv2dDynamicSamePadding (padding from the input's size) through lss's kernels."""

    def _padding(self, x: torch.Tensor) -> tuple[int, int, int, int]:
        return same_padding(x.shape[-2:], self.weight.shape[-2:], self.stride)


class StaticSameDepthwiseConv2d(_LssDepthwise, Conv2dStaticSamePadding):
    """Conv2dStaticSamePadding (padding fixed when built: EfficientNet.from_name's) through lss's
    kernels."""

    def _padding(self, x: torch.Tensor) -> tuple[int, int, int, int]:
        pad = self.static_padding
        if isinstance(pad, nn.ZeroPad2d):
            left, right, top, bottom = pad.padding
            return (top, bottom, left, right)
        return (0, 0, 0, 0)


_LSS_DEPTHWISE = {
    Conv2dDynamicSamePadding: SameDepthwiseConv2d,
    Conv2dStaticSamePadding: StaticSameDepthwiseConv2d,
}


def use_lss_depthwise_conv(module: nn.Module, on_cpu: bool = True) -> int:
    """Turns every depthwise convolution of efficientnet-pytorch in `module`
    (Conv2dDynamicSamePadding or Conv2dStaticSamePadding with groups equal to the input and output
    channels, no dilation, filters up to 7 x 7) into its lss counterpart in place, keeping
    parameters and state dict keys; returns how many. `on_cpu` False: CPU inputs keep PyTorch's
    kernels."""
    count = 0
    for m in module.modules():
        ours = _LSS_DEPTHWISE.get(type(m))
        if (
            ours is not None
            and m.groups == m.in_channels == m.out_channels
            and tuple(m.dilation) == (1, 1)
            and max(m.kernel_size) <= MAX_KERNEL
        ):
            m.__class__ = ours
            m.on_cpu = on_cpu
            count += 1
    return count


class ResNetTrunk(nn.Module):
    """torchvision's ResNet-18 (random initialisation) up to the stage of stride 2 * `downsample`;
    returns the maps of stride `downsample` and 2 * `downsample` (downsample 8: layer2 and layer3;
    16: layer3 and layer4).

    forward(images B x 3 x H x W) -> (B x C1 x H/s x W/s, B x C2 x H/2s x W/2s), s = downsample.
    """

    def __init__(self, downsample: int = 16):
        super().__init__()
        net = resnet18(weights=None)
        self.stem = nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool)  # stride 4
        layers = [net.layer1, net.layer2, net.layer3, net.layer4]
        last = {8: 3, 16: 4}[downsample]
        self.layers = nn.Sequential(*layers[:last])
        self.fine_channels, self.coarse_channels = (128, 256) if downsample == 8 else (256, 512)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.layers[:-1](self.stem(images))
        return x, self.layers[-1](x)


def pixel_table(mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """lss.geometry.camera.pixel_lut as the 768 x 1 channel-major table of normalize_pixels."""
    return torch.from_numpy(pixel_lut(mean, std).T.copy()).reshape(-1, 1)


def normalize_pixels(images: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """uint8 RGB images ... x 3 x H x W -> float32 through `table` (pixel_table) on their device:
    the values of the loader's data.image_dtype float32. Float images are returned as they are."""
    if images.dtype != torch.uint8:
        return images
    if images.dim() < 3 or images.shape[-3] != 3:
        raise ValueError(f"uint8 images must be ... x 3 x H x W RGB, got {tuple(images.shape)}")
    offsets = torch.arange(0, 768, 256, device=images.device, dtype=torch.int32)
    index = images.int() + offsets.view(3, 1, 1)
    return F.embedding(index, table.to(images.device)).squeeze(-1)


class CameraEncoder(nn.Module):
    """Lift: per camera pixel of the stride-s feature map (s = `downsample`), a softmax depth
    distribution over D bins and C context features.

    forward(images B*N x 3 x H x W) -> (depth B*N x D x H/s x W/s (probabilities), context
    B*N x C x H/s x W/s); with return_logits=True also the depth logits B*N x D x H/s x W/s (for
    a depth loss) as a third element. Images are uint8 RGB (normalised here with the model's
    image_mean / image_std) or float, already normalised.
    """

    def __init__(
        self,
        depth_bins: int,
        context_channels: int,
        backbone: str = "efficientnet-b0",
        pretrained: Optional[str] = None,
        upsample_mode: str = "pytorch_half_pixel",
        downsample: int = 16,
        channels: int = 512,
        image_mean: Sequence[float] = (0.485, 0.456, 0.406),
        image_std: Sequence[float] = (0.229, 0.224, 0.225),
    ):
        super().__init__()
        # uint8 inputs are normalised with it (not in the state dict)
        self.register_buffer("pixel_table", pixel_table(image_mean, image_std), persistent=False)
        self.depth_bins = depth_bins
        self.context_channels = context_channels
        if backbone == "resnet18":
            self.trunk = ResNetTrunk(downsample)
            fine, coarse = self.trunk.fine_channels, self.trunk.coarse_channels
        else:
            self.trunk = EfficientNetTrunk(backbone, pretrained)
            fine, coarse = EfficientNetTrunk.stride16_channels, EfficientNetTrunk.stride32_channels
        self.fuse = Up(fine + coarse, channels, upsample_mode=upsample_mode)
        self.head = nn.Conv2d(channels, depth_bins + context_channels, kernel_size=1)

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        """normalize_pixels with the model's image_mean / image_std: uint8 images -> float32,
        float images as they are."""
        return normalize_pixels(images, self.pixel_table)

    def forward(
        self, images: torch.Tensor, return_logits: bool = False
    ) -> tuple[torch.Tensor, ...]:
        fine, coarse = self.trunk(self.normalize(images))
        out = self.head(self.fuse(coarse, fine))
        logits = out[:, : self.depth_bins]
        context = out[:, self.depth_bins :]
        depth = logits.softmax(dim=1)
        return (depth, context, logits) if return_logits else (depth, context)
