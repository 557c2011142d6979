"""The PyTorch tutorial "Neural Transfer Using PyTorch" and pytorch/examples fast_neural_style and
super_resolution, shrunk (a small VGG-like feature net in place of the downloaded VGG19):

- neural transfer: a ``Normalization`` module whose mean/std are ``.view(-1, 1, 1)`` tensors,
  ``ContentLoss``/``StyleLoss`` modules holding ``.detach()``-ed targets, the model rebuilt by
  walking ``cnn.children()`` and renaming layers, trimmed after the last loss module, then
  ``optim.LBFGS([input_img])`` over an image that requires grad with the tutorial's ``run = [0]``
  closure, clamped both ways (``input_img.data.clamp_(0, 1)`` inside the closure, as the older
  tutorial does, and ``with torch.no_grad(): input_img.clamp_(0, 1)`` after it);
- fast_neural_style: ``TransformerNet`` (ReflectionPad2d, InstanceNorm2d(affine=True), residual
  blocks, an upsampling conv by ``F.interpolate``), a VGG-like loss net returning a namedtuple,
  ``normalize_batch`` by ``batch.div_(255.0)`` and ``new_tensor``, Gram matrices by ``bmm``;
- super_resolution: ``PixelShuffle`` and ``init.orthogonal_(w, init.calculate_gain('relu'))``,
  the PSNR loop."""
import copy
import json
import math
from collections import namedtuple

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.init as init
import torch.optim as optim

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
gen = torch.Generator().manual_seed(0)
out = {}

cnn = nn.Sequential(
    nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(inplace=True),
    nn.MaxPool2d(2), nn.Conv2d(8, 12, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(12, 12, 3, padding=1),
    nn.ReLU(inplace=True), nn.MaxPool2d(2), nn.Conv2d(12, 16, 3, padding=1), nn.ReLU(inplace=True),
).to(device).eval()
cnn_normalization_mean = torch.tensor([0.485, 0.456, 0.406]).to(device)
cnn_normalization_std = torch.tensor([0.229, 0.224, 0.225]).to(device)
style_img = torch.rand(1, 3, 16, 16, generator=gen).to(device, torch.float)
content_img = torch.rand(1, 3, 16, 16, generator=gen).to(device, torch.float)
assert style_img.size() == content_img.size()


class ContentLoss(nn.Module):
    def __init__(self, target):
        super().__init__()
        self.target = target.detach()

    def forward(self, input):
        self.loss = F.mse_loss(input, self.target)
        return input


def gram_matrix(input):
    a, b, c, d = input.size()
    features = input.view(a * b, c * d)
    G = torch.mm(features, features.t())
    return G.div(a * b * c * d)


class StyleLoss(nn.Module):
    def __init__(self, target_feature):
        super().__init__()
        self.target = gram_matrix(target_feature).detach()

    def forward(self, input):
        G = gram_matrix(input)
        self.loss = F.mse_loss(G, self.target)
        return input


class Normalization(nn.Module):
    def __init__(self, mean, std):
        super().__init__()
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def forward(self, img):
        return (img - self.mean) / self.std


content_layers_default = ["conv_4"]
style_layers_default = ["conv_1", "conv_2", "conv_3", "conv_4"]


def get_style_model_and_losses(cnn, normalization_mean, normalization_std, style_img, content_img,
                               content_layers=content_layers_default, style_layers=style_layers_default):
    normalization = Normalization(normalization_mean, normalization_std)
    content_losses = []
    style_losses = []
    model = nn.Sequential(normalization)
    i = 0
    for layer in cnn.children():
        if isinstance(layer, nn.Conv2d):
            i += 1
            name = f"conv_{i}"
        elif isinstance(layer, nn.ReLU):
            name = f"relu_{i}"
            layer = nn.ReLU(inplace=False)
        elif isinstance(layer, nn.MaxPool2d):
            name = f"pool_{i}"
        elif isinstance(layer, nn.BatchNorm2d):
            name = f"bn_{i}"
        else:
            raise RuntimeError(f"Unrecognized layer: {layer.__class__.__name__}")
        model.add_module(name, layer)
        if name in content_layers:
            target = model(content_img).detach()
            content_loss = ContentLoss(target)
            model.add_module(f"content_loss_{i}", content_loss)
            content_losses.append(content_loss)
        if name in style_layers:
            target_feature = model(style_img).detach()
            style_loss = StyleLoss(target_feature)
            model.add_module(f"style_loss_{i}", style_loss)
            style_losses.append(style_loss)
    for i in range(len(model) - 1, -1, -1):
        if isinstance(model[i], (ContentLoss, StyleLoss)):
            break
    model = model[:(i + 1)]
    return model, style_losses, content_losses


def get_input_optimizer(input_img):
    return optim.LBFGS([input_img])


def run_style_transfer(cnn, normalization_mean, normalization_std, content_img, style_img, input_img,
                       num_steps=12, style_weight=1000000, content_weight=1, data_clamp=True):
    model, style_losses, content_losses = get_style_model_and_losses(
        cnn, normalization_mean, normalization_std, style_img, content_img)
    input_img.requires_grad_(True)
    model.eval()
    model.requires_grad_(False)
    optimizer = get_input_optimizer(input_img)
    run = [0]
    trace = []
    while run[0] <= num_steps:
        def closure():
            if data_clamp:
                input_img.data.clamp_(0, 1)
            else:
                with torch.no_grad():
                    input_img.clamp_(0, 1)
            optimizer.zero_grad()
            model(input_img)
            style_score = 0
            content_score = 0
            for sl in style_losses:
                style_score += sl.loss
            for cl in content_losses:
                content_score += cl.loss
            style_score *= style_weight
            content_score *= content_weight
            loss = style_score + content_score
            loss.backward()
            run[0] += 1
            if run[0] % 5 == 0:
                trace.append([run[0], style_score.item(), content_score.item()])
            return style_score + content_score
        optimizer.step(closure)
    with torch.no_grad():
        input_img.clamp_(0, 1)
    return input_img, trace, [n for n, _ in model.named_children()]


for data_clamp in (True, False):
    input_img = content_img.clone()
    output, trace, names = run_style_transfer(cnn, cnn_normalization_mean, cnn_normalization_std,
                                              content_img, style_img, input_img, data_clamp=data_clamp)
    out[f"transfer_{data_clamp}"] = {"trace": trace, "names": names, "mean": output.mean().item(),
                                     "min": output.min().item(), "max": output.max().item(),
                                     "requires_grad": output.requires_grad, "is_input": output is input_img}


# --- fast_neural_style
class ConvLayer(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, stride):
        super().__init__()
        reflection_padding = kernel_size // 2
        self.reflection_pad = nn.ReflectionPad2d(reflection_padding)
        self.conv2d = nn.Conv2d(in_channels, out_channels, kernel_size, stride)

    def forward(self, x):
        return self.conv2d(self.reflection_pad(x))


class ResidualBlock(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv1 = ConvLayer(channels, channels, kernel_size=3, stride=1)
        self.in1 = nn.InstanceNorm2d(channels, affine=True)
        self.conv2 = ConvLayer(channels, channels, kernel_size=3, stride=1)
        self.in2 = nn.InstanceNorm2d(channels, affine=True)
        self.relu = nn.ReLU()

    def forward(self, x):
        residual = x
        out = self.relu(self.in1(self.conv1(x)))
        out = self.in2(self.conv2(out))
        return out + residual


class UpsampleConvLayer(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, stride, upsample=None):
        super().__init__()
        self.upsample = upsample
        self.reflection_pad = nn.ReflectionPad2d(kernel_size // 2)
        self.conv2d = nn.Conv2d(in_channels, out_channels, kernel_size, stride)

    def forward(self, x):
        x_in = x
        if self.upsample:
            x_in = F.interpolate(x_in, mode="nearest", scale_factor=self.upsample)
        return self.conv2d(self.reflection_pad(x_in))


class TransformerNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = ConvLayer(3, 8, kernel_size=9, stride=1)
        self.in1 = nn.InstanceNorm2d(8, affine=True)
        self.conv2 = ConvLayer(8, 16, kernel_size=3, stride=2)
        self.in2 = nn.InstanceNorm2d(16, affine=True)
        self.res1 = ResidualBlock(16)
        self.res2 = ResidualBlock(16)
        self.deconv1 = UpsampleConvLayer(16, 8, kernel_size=3, stride=1, upsample=2)
        self.in4 = nn.InstanceNorm2d(8, affine=True)
        self.deconv3 = ConvLayer(8, 3, kernel_size=9, stride=1)
        self.relu = nn.ReLU()

    def forward(self, X):
        y = self.relu(self.in1(self.conv1(X)))
        y = self.relu(self.in2(self.conv2(y)))
        y = self.res2(self.res1(y))
        y = self.relu(self.in4(self.deconv1(y)))
        return self.deconv3(y)


class Vgg(nn.Module):
    def __init__(self, features, requires_grad=False):
        super().__init__()
        self.slice1 = nn.Sequential(*[features[x] for x in range(2)])
        self.slice2 = nn.Sequential(*[features[x] for x in range(2, 7)])
        self.slice3 = nn.Sequential(*[features[x] for x in range(7, 12)])
        if not requires_grad:
            for param in self.parameters():
                param.requires_grad = False

    def forward(self, X):
        h_relu1 = self.slice1(X)
        h_relu2 = self.slice2(h_relu1)
        h_relu3 = self.slice3(h_relu2)
        vgg_outputs = namedtuple("VggOutputs", ["relu1", "relu2", "relu3"])
        return vgg_outputs(h_relu1, h_relu2, h_relu3)


def gram_matrix_batch(y):
    (b, ch, h, w) = y.size()
    features = y.view(b, ch, w * h)
    features_t = features.transpose(1, 2)
    return features.bmm(features_t) / (ch * h * w)


def normalize_batch(batch):
    mean = batch.new_tensor([0.485, 0.456, 0.406]).view(-1, 1, 1)
    std = batch.new_tensor([0.229, 0.224, 0.225]).view(-1, 1, 1)
    batch = batch.div_(255.0)
    return (batch - mean) / std


transformer = TransformerNet().to(device)
optimizer = optim.Adam(transformer.parameters(), 1e-3)
mse_loss = torch.nn.MSELoss()
vgg = Vgg(copy.deepcopy(cnn), requires_grad=False).to(device)
style = (torch.rand(1, 3, 16, 16, generator=gen) * 255).to(device).repeat(2, 1, 1, 1)
features_style = vgg(normalize_batch(style))
gram_style = [gram_matrix_batch(y) for y in features_style]
images = torch.rand(4, 3, 16, 16, generator=gen) * 255
transformer.train()
agg = []
for batch_id in range(2):
    x = images[batch_id * 2:(batch_id + 1) * 2].to(device)
    n_batch = len(x)
    optimizer.zero_grad()
    y = transformer(x)
    y = normalize_batch(y)
    x = normalize_batch(x)
    features_y = vgg(y)
    features_x = vgg(x)
    content_loss = 1e5 * mse_loss(features_y.relu2, features_x.relu2)
    style_loss = 0.
    for ft_y, gm_s in zip(features_y, gram_style):
        gm_y = gram_matrix_batch(ft_y)
        style_loss += mse_loss(gm_y, gm_s[:n_batch, :, :])
    style_loss *= 1e10
    total_loss = content_loss + style_loss
    total_loss.backward()
    optimizer.step()
    agg.append([content_loss.item(), style_loss.item()])
transformer.eval()
with torch.no_grad():
    stylized = transformer(images[:1].to(device)).clamp(0, 255)
img = stylized[0].clone().cpu().clamp(0, 255).numpy().transpose(1, 2, 0).astype("uint8")
out["fast_style"] = {"losses": agg, "stylized_mean": stylized.mean().item(), "img_sum": int(img.sum()),
                     "in1_weight": transformer.in1.weight.sum().item(),
                     "state_keys": len(transformer.state_dict())}


# --- super_resolution
class Net(nn.Module):
    def __init__(self, upscale_factor):
        super().__init__()
        self.relu = nn.ReLU()
        self.conv1 = nn.Conv2d(1, 16, (5, 5), (1, 1), (2, 2))
        self.conv2 = nn.Conv2d(16, 16, (3, 3), (1, 1), (1, 1))
        self.conv3 = nn.Conv2d(16, 8, (3, 3), (1, 1), (1, 1))
        self.conv4 = nn.Conv2d(8, upscale_factor ** 2, (3, 3), (1, 1), (1, 1))
        self.pixel_shuffle = nn.PixelShuffle(upscale_factor)
        self._initialize_weights()

    def forward(self, x):
        x = self.relu(self.conv1(x))
        x = self.relu(self.conv2(x))
        x = self.relu(self.conv3(x))
        return self.pixel_shuffle(self.conv4(x))

    def _initialize_weights(self):
        init.orthogonal_(self.conv1.weight, init.calculate_gain("relu"))
        init.orthogonal_(self.conv2.weight, init.calculate_gain("relu"))
        init.orthogonal_(self.conv3.weight, init.calculate_gain("relu"))
        init.orthogonal_(self.conv4.weight)


model = Net(upscale_factor=3).to(device)
criterion = nn.MSELoss()
optimizer = optim.Adam(model.parameters(), lr=0.01)
hr = torch.rand(6, 1, 12, 12, generator=gen)
lr_imgs = F.avg_pool2d(hr, 3)
epoch_loss = []
for i in range(3):
    input, target = lr_imgs[i * 2:(i + 1) * 2].to(device), hr[i * 2:(i + 1) * 2].to(device)
    optimizer.zero_grad()
    loss = criterion(model(input), target)
    epoch_loss.append(loss.item())
    loss.backward()
    optimizer.step()
avg_psnr = 0
with torch.no_grad():
    for i in range(3):
        input, target = lr_imgs[i * 2:(i + 1) * 2].to(device), hr[i * 2:(i + 1) * 2].to(device)
        mse = criterion(model(input), target)
        avg_psnr += 10 * math.log10(1 / mse.item())
    unshuffled = F.pixel_unshuffle(model(lr_imgs[:1].to(device)), 3)
out["super_resolution"] = {"losses": epoch_loss, "psnr": avg_psnr / 3, "unshuffled_shape": list(unshuffled.shape),
                           "unshuffled_sum": unshuffled.sum().item()}
out["device"] = str(stylized.device)
print(json.dumps(out))
