"""Real-world training code, each loop twice: as its source writes it by hand, and ported to
``safeloop.Trainer``. Every case trains a tiny seeded model on synthetic data for 4-6 steps both
ways and asserts that every parameter and buffer of the port equals the hand loop's bit for bit,
under ``guard.check`` = ``auto``, ``always`` and ``off``, with warnings as errors (those the hand
loop emits itself excepted). The hand loops keep their source's autograd shape: the same
``retain_graph`` / ``create_graph`` / ``inputs=`` / ``detach`` / in-place / ``no_grad`` use and the same
order of backwards and optimizer steps. ``harness.py`` holds what every case runs.

A case the guard wrongly stops is marked ``xfail(strict=True, raises=<error>)`` in ``harness.checks``
with the cause, so that it turns into a failure the day the guard is fixed.

| test | source (repository, file) | what it exercises |
|---|---|---|
| test_gans::test_wgan_gp | eriklindernoren/PyTorch-GAN, implementations/wgan_gp/wgan_gp.py | gradient penalty (`autograd.grad(create_graph=True)`), D's loss through an undetached G, BatchNorm in G, G every `n_critic` steps (manual) |
| test_gans::test_spectral_norm_gan | christiancosgrove/pytorch-spectral-normalization-gan, main.py | spectral norm's power-iteration buffers moved by every forward, hinge loss (manual) |
| test_gans::test_cyclegan_with_an_image_pool (and `_in_automatic_mode`) | junyanz/pytorch-CycleGAN-and-pix2pix, models/cycle_gan_model.py, models/networks.py, util/image_pool.py | two generators and two discriminators in two optimizers (`itertools.chain`), the discriminators frozen through `requires_grad` while the generators' loss goes through them, a pool of past fakes kept as `.data` and drawn with Python's `random`, two backwards into one optimizer, in-place LeakyReLU, instance norm (manual; automatic: both losses returned) |
| test_contrastive::test_moco (and `_with_full_undo`) | facebookresearch/moco, moco/builder.py, main_moco.py | a momentum-updated key encoder whose frozen parameters the optimizer holds, replaced through `param.data =` inside the forward (new storage every step; `undo=full` snapshots and restores it); a queue buffer of keys overwritten in place under `no_grad` and read through `clone().detach()`; BatchNorm in both encoders; single process (no key gather or batch shuffle) |
| test_byol::test_byol (and `_resumed_midway`) | lucidrains/byol-pytorch, byol_pytorch/byol_pytorch.py, README.md | a representation taken by a forward hook on a hidden layer; the projector and target encoder made lazily (`singleton`) by a mock forward in `__init__`, before the optimizer over `learner.parameters()` is built; the target a deepcopy with `requires_grad` off, run under `no_grad`, whose frozen parameters Adam holds; an EMA update through `ma_params.data =` in `on_step_end`; simplicial embeddings; BatchNorm in every part; a symmetric cosine loss; resumed mid-run from a checkpoint file |
| test_swa::test_stochastic_weight_averaging | pytorch/pytorch, docs/source/optim.rst (torch.optim.swa_utils) | an `AveragedModel` (deep copy, `n_averaged` buffer) updated at epoch ends after `swa_start`, `CosineAnnealingLR` and `SWALR` on one optimizer handing over at `swa_start` (stepped by the port: one scheduler per optimizer is what safeloop steps), `update_bn` over the training data at the end (BatchNorm), the averaged model checkpointed through `modules()` |
| test_rl::test_actor_critic | pytorch/examples, reinforcement_learning/actor_critic.py | an episode played inside the step, graphs kept in lists on the module |
| test_rl::test_reinforce_with_episodes_played_by_the_data_iterator | pytorch/examples, reinforcement_learning/reinforce.py | the policy's graph made while the batch is fetched, dropout |
| test_rl::test_soft_actor_critic | pranz24/pytorch-soft-actor-critic, sac.py, model.py, utils.py | three optimizers; a critic loss back-propagated after the critic stepped (through weights the step left alone); `alpha = log_alpha.exp()` used with its graph one update later; soft target update (manual) |
| test_rl::test_ppo_lagrangian | PKU-Alignment/omnisafe, omnisafe/common/lagrange.py, algorithms/on_policy/naive_lagrange/ppo_lag.py | a multiplier with its own optimizer, clamped in place through `.data`, read with `.item()` (manual) |
| test_rl::test_dqn_with_a_replay_memory_and_a_soft_updated_target | pytorch/tutorials, intermediate_source/reinforcement_q_learning.py | the environment stepped by the data iterator with the current policy (`no_grad`, epsilon-greedy), a replay memory, a target network in the model that takes no gradient (`no_grad`), soft-updated through `load_state_dict` after every step, `clip_grad_value_`, AdamW with `amsgrad` |
| test_gradients::test_maml | dragen1860/MAML-Pytorch, meta.py, learner.py | inner-loop `autograd.grad`, fast weights, functional BatchNorm updating parameters without gradient |
| test_gradients::test_sharpness_aware_minimization | davda54/sam, sam.py, example/train.py, example/utility/bypass_bn.py | two forward-backward passes, weights perturbed in place and restored through `p.data` (manual) |
| test_gradients::test_physics_informed_net | jayroxis/PINNs, "Burgers Equation/Burgers Identification (PyTorch).ipynb" (a port of maziarraissi/PINNs) | `torch.tensor(X, requires_grad=True).float()` inputs made before training, derivatives w.r.t. them with `create_graph=True` |
| test_gradients::test_fgsm_adversarial_training | locuslab/fast_adversarial, CIFAR10/train_fgsm.py | the attack's gradient w.r.t. the input, `delta.data` edits, a cyclic LR schedule |
| test_models::test_tbptt_language_model | pytorch/examples, word_language_model/main.py, model.py | an LSTM's hidden state carried between steps and detached at the start of the next, clipping |
| test_models::test_vae | pytorch/examples, vae/main.py | reparameterization noise, two terms returned by name and summed |
| test_models::test_mean_teacher | CuriousAI/mean-teacher, pytorch/main.py, pytorch/mean_teacher/losses.py | an EMA teacher (parameters detached, BatchNorm in train mode) updated after each step; a constant zero term |
| test_models::test_knowledge_distillation | peterliht/knowledge-distillation-pytorch, train.py, model/net.py | a frozen teacher in eval mode under `no_grad` |
| test_models::test_checkpointed_densenet_with_batchnorm | pytorch/vision, torchvision/models/densenet.py (memory_efficient); pytorch/examples, imagenet/main.py | non-reentrant `torch.utils.checkpoint` around BatchNorm (recomputed in backward) |
| test_models::test_compiled_gpt_with_gradient_accumulation | karpathy/nanoGPT, train.py, model.py | `torch.compile`, tied embedding, two AdamW parameter groups, accumulation and clipping |
| test_models::test_scripted_ensemble_with_forked_members | pytorch/tutorials, advanced_source/torch-script-parallelism.rst | a TorchScript model whose members run in `torch.jit.fork` tasks (other threads) |
"""
