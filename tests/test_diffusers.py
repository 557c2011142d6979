"""diffusers programs as its tutorials write them, built from tiny configs (no downloads): the
"train a diffusion model" loop with EMA, sampling loops (DDIM; Euler ancestral drawing from a CPU
generator), DDPMPipeline with a CPU generator, a VAE, and a Flux transformer (whose attention
dispatch calls SDPA with keyword arguments). Each runs on the local CPU and through the gateway
and must give the same values."""
from __future__ import annotations

import pytest

pytest.importorskip("diffusers")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from diffusers import (  # noqa: E402
    AutoencoderKL,
    DDIMScheduler,
    DDPMPipeline,
    DDPMScheduler,
    EulerAncestralDiscreteScheduler,
    FluxTransformer2DModel,
    UNet2DModel,
)
from diffusers.training_utils import EMAModel  # noqa: E402
from local_parity import assert_matches_local, registry  # noqa: E402
from local_parity import data as D  # noqa: E402

pytestmark = pytest.mark.usefixtures("remote")
CASES, case = registry()


def _unet() -> UNet2DModel:
    torch.manual_seed(0)
    return UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(8, 16),
                       norm_num_groups=4, attention_head_dim=4, down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                       up_block_types=("AttnUpBlock2D", "UpBlock2D"))


@case
def train_loop_with_ema(dev):
    model = _unet().to(dev)
    sched = DDPMScheduler(num_train_timesteps=100)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ema = EMAModel(model.parameters(), decay=0.9)
    ema.to(dev)
    losses = []
    for step in range(2):
        clean, noise = D(1, 3, 8, 8, seed=step).to(dev), D(1, 3, 8, 8, seed=10 + step).to(dev)
        ts = torch.randint(0, sched.config.num_train_timesteps, (1,), generator=torch.Generator().manual_seed(step))
        noisy = sched.add_noise(clean, noise, ts.to(dev))
        loss = F.mse_loss(model(noisy, ts.to(dev), return_dict=False)[0], noise)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        ema.step(model.parameters())
        losses.append(loss.detach())
    ema.copy_to(model.parameters())
    return torch.stack(losses), model.conv_out.weight


def _sample(dev, sched, generator=None):
    model = _unet().to(dev).eval()
    sched.set_timesteps(3, device=dev)
    x = D(1, 3, 8, 8, seed=3).to(dev) * sched.init_noise_sigma
    with torch.no_grad():
        for t in sched.timesteps:
            eps = model(sched.scale_model_input(x, t), t).sample
            x = sched.step(eps, t, x, generator=generator).prev_sample
    return x


@case
def sample_ddim(dev):
    return _sample(dev, DDIMScheduler(num_train_timesteps=100))


@case
def sample_euler_ancestral_cpu_generator(dev):
    return _sample(dev, EulerAncestralDiscreteScheduler(num_train_timesteps=100), torch.Generator("cpu").manual_seed(0))


@case
def ddpm_pipeline_cpu_generator(dev):
    pipe = DDPMPipeline(_unet(), DDPMScheduler(num_train_timesteps=100)).to(dev)
    pipe.set_progress_bar_config(disable=True)
    out = pipe(batch_size=1, num_inference_steps=2, generator=torch.Generator("cpu").manual_seed(0), output_type="pt")
    return out.images, torch.tensor(pipe.device.type == torch.device(dev).type)


@case
def vae_encode_sample_decode(dev):
    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16), norm_num_groups=4,
                        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
                        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D")).to(dev)
    dist = vae.encode(D(1, 3, 8, 8).to(dev)).latent_dist
    z = dist.sample(generator=torch.Generator("cpu").manual_seed(0)) * vae.config.scaling_factor
    rec = vae.decode(z / vae.config.scaling_factor).sample
    (F.mse_loss(rec, D(1, 3, 8, 8).to(dev)) + 1e-6 * dist.kl().mean()).backward()
    return rec, vae.encoder.conv_in.weight.grad


@case
def flux_transformer(dev):
    torch.manual_seed(0)
    m = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8,
                               num_attention_heads=2, joint_attention_dim=8, pooled_projection_dim=8,
                               axes_dims_rope=(2, 2, 4)).to(dev)
    img_ids = torch.stack([torch.zeros(16), torch.arange(16.0) // 4, torch.arange(16.0) % 4], 1)
    out = m(hidden_states=D(1, 16, 4).to(dev), encoder_hidden_states=D(1, 3, 8, seed=1).to(dev),
            pooled_projections=D(1, 8, seed=2).to(dev), timestep=torch.tensor([0.5]).to(dev),
            img_ids=img_ids.to(dev), txt_ids=torch.zeros(3, 3).to(dev), return_dict=False)[0]
    out.square().mean().backward()
    return out, m.x_embedder.weight.grad


@pytest.mark.parametrize("name", sorted(CASES))
def test_program_matches_local(name):
    assert_matches_local(CASES[name])
