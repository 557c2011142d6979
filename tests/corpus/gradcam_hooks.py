"""Grad-CAM as tutorials write it, with the autograd hooks around it: forward hooks keeping a
layer's activations, ``register_full_backward_hook`` keeping its output's gradient, a forward
pre-hook, a tensor hook that rescales a gradient, the backward started with ``gradient=one_hot``,
the map upsampled with ``F.interpolate(mode="bilinear")`` and normalised by its min and max."""
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
gen = torch.Generator().manual_seed(3)

model = nn.Sequential(
    nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(),
    nn.Conv2d(6, 8, 3, padding=1), nn.ReLU(),
    nn.MaxPool2d(2),
    nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
    nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5),
).to(device).eval()
target_layer = model[5]


class GradCAM:
    def __init__(self, model, layer):
        self.model = model
        self.activations = None
        self.gradients = None
        self.pre_shapes = []
        self.handles = [
            layer.register_forward_hook(self.save_activation),
            layer.register_full_backward_hook(self.save_gradient),
            layer.register_forward_pre_hook(self.record_input),
        ]

    def record_input(self, module, args):
        self.pre_shapes.append(list(args[0].shape))

    def save_activation(self, module, inp, output):
        self.activations = output.detach()

    def save_gradient(self, module, grad_input, grad_output):
        self.gradients = grad_output[0].detach()

    def __call__(self, x, class_idx=None):
        output = self.model(x)
        if class_idx is None:
            class_idx = output.argmax(dim=1)
        one_hot = torch.zeros_like(output)
        one_hot.scatter_(1, class_idx.view(-1, 1), 1.0)
        self.model.zero_grad()
        output.backward(gradient=one_hot, retain_graph=True)
        weights = self.gradients.mean(dim=(2, 3), keepdim=True)
        cam = F.relu((weights * self.activations).sum(dim=1, keepdim=True))
        cam = F.interpolate(cam, size=x.shape[2:], mode="bilinear", align_corners=False)
        flat = cam.view(cam.size(0), -1)
        lo, hi = flat.min(dim=1, keepdim=True)[0], flat.max(dim=1, keepdim=True)[0]
        cam = ((flat - lo) / (hi - lo + 1e-8)).view_as(cam)
        return cam, output, class_idx

    def remove(self):
        for h in self.handles:
            h.remove()


images = torch.rand(2, 3, 12, 12, generator=gen).to(device).requires_grad_(True)
grads_seen = []


def scale_hook(grad):
    grads_seen.append(grad.abs().sum().item())
    return grad * 0.5


images.register_hook(scale_hook)
cam_maker = GradCAM(model, target_layer)
cam, logits, cls = cam_maker(images)
cam_maker.remove()
saliency = images.grad.abs().amax(dim=1)
out_again = model(images)  # hooks removed: nothing more is recorded
print(json.dumps({
    "cam": cam.flatten(1)[:, ::7].cpu().tolist(),
    "cam_sum": cam.sum().item(),
    "classes": cls.cpu().tolist(),
    "logits": logits.detach().cpu().tolist(),
    "pre_shapes": cam_maker.pre_shapes,
    "grads_seen": grads_seen,
    "saliency": saliency.sum(dim=(1, 2)).cpu().tolist(),
    "weight_grad": model[2].weight.grad.sum().item(),
    "same_after_remove": torch.equal(out_again, logits),
    "device": str(cam.device),
}))
