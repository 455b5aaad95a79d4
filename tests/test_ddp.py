"""torchrun on CPU (gloo): 2 ranks, each sampling and training on half the step's prompts, end up
with the weights one process gets from the same global batch; DDP and FSDP2 alike; only rank 0
writes; a killed run resumes."""
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# tiny model, 4 prompts x 4 samples per step; micro-batches of 4 rows so each rank accumulates over
# several (and, when filter_zero_std drops a group on one rank only, the ranks have different
# numbers of them)
TINY = ['--init_from=scratch', '--task=arith', '--system_prompt=', '--instruction=', '--n_layer=1',
        '--n_embd=32', '--n_head=2', '--n_kv_head=1', '--max_seq_len=160', '--group_size=4',
        '--batch_prompts=4', '--micro_batch_size=4', '--max_new_tokens=8', '--arith_n_train=200',
        '--arith_n_test=8', '--eval_examples=4', '--eval_every=0', '--device=cpu',
        '--dtype=float32', '--plot_every=0', '--export_hf=False', '--lr=1e-3', '--warmup_steps=1',
        '--watchdog_s=0', "--rewards=[{'name': 'grpo_test_rewards:digit_fraction'}]",
        '--max_steps=3', '--save_every=1', '--keep_last=10']
SAME = ['reward/mean', 'reward/std', 'frac_zero_std', 'rows_trained', 'tokens_trained',
        'response_len/mean']
# sums over ranks: equal up to float rounding
CLOSE = ['loss', 'grad_norm', 'entropy', 'logprob/mean']
ENV = {**os.environ, 'PYTHONPATH': str(ROOT / 'tests'), 'PYTHONUNBUFFERED': '1',
       'OMP_NUM_THREADS': '1'}


def cmd(out_dir, nproc, *args):
    if nproc == 0:
        launch = [sys.executable]
    else:
        launch = [sys.executable, '-m', 'torch.distributed.run', '--standalone',
                  f'--nproc_per_node={nproc}']
    return [*launch, str(ROOT / 'train_grpo.py'), *TINY, f'--out_dir={out_dir}', *args]


def run(out_dir, nproc, *args, check=True):
    """nproc=0: a plain one-process run; otherwise torchrun with nproc ranks."""
    p = subprocess.run(cmd(out_dir, nproc, *args), cwd=ROOT, env=ENV, capture_output=True,
                       text=True, timeout=180)
    if check and p.returncode != 0:
        raise AssertionError(f"exit {p.returncode}\n--- stdout\n{p.stdout[-3000:]}"
                             f"\n--- stderr\n{p.stderr[-5000:]}")
    return p


def metrics(out_dir):
    return [json.loads(line) for line in open(Path(out_dir) / 'metrics.jsonl')]


def weights(out_dir, step):
    return torch.load(Path(out_dir) / f'ckpt_{step:07d}.pt', weights_only=False)['model']


def assert_same_run(ref_dir, out_dir, what, tol=1e-5):
    ra = metrics(ref_dir)
    rb = metrics(out_dir)
    steps = [r['step'] for r in rb]
    assert steps == [0, 1, 2, 3], f"{what}: metrics.jsonl steps {steps}, each once"
    # same prompts, same seeds per (prompt, sample): the very same completions
    for a, b in zip(ra[1:], rb[1:]):
        for k in SAME:
            assert a[k] == b[k], f"{what}: step {a['step']} {k} = {b[k]}, one process got {a[k]}"
        for k in CLOSE:
            assert math.isclose(a[k], b[k], rel_tol=tol, abs_tol=1e-7), \
                f"{what}: step {a['step']} {k} = {b[k]}, one process got {a[k]}"
    wa = weights(ref_dir, 3)
    wb = weights(out_dir, 3)
    assert wa.keys() == wb.keys(), f"{what}: checkpoint holds {sorted(wb)}, expected {sorted(wa)}"
    for k in wa:
        err = (wa[k] - wb[k]).abs().max().item()
        assert torch.allclose(wa[k], wb[k], rtol=0, atol=tol), \
            f"{what}: {k} differs from one process by {err:.2e}"
    # LoRA: adapters only
    key = 'wte.weight' if 'wte.weight' in wb else 'h.0.mlp.c_fc.lora_B.up_proj'
    assert not torch.equal(weights(out_dir, 0)[key], wb[key]), f"{what}: nothing was trained"


@pytest.fixture(scope='module')
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp('one_process')
    run(out, 0)
    return out


def test_two_ddp_ranks_match_one_process(one_process, tmp_path):
    p = run(tmp_path, 2)
    assert_same_run(one_process, tmp_path, 'DDP, 2 ranks')
    assert p.stdout.count('step     3 |') == 1, "only rank 0 prints the per-step line"


def test_two_fsdp_ranks_match_one_process(one_process, tmp_path):
    run(tmp_path, 2, '--fsdp=True')
    assert_same_run(one_process, tmp_path, 'FSDP2, 2 ranks')


# each rank: FSDP2 shards of a small model, its gradients clipped by parallel.clip_grad_norm
NORM_SCRIPT = """
import sys
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
sys.path.insert(0, sys.argv[1])
from parallel import clip_grad_norm
dist.init_process_group('gloo')
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 3))
for layer in m:
    fully_shard(layer)
fully_shard(m)
m(torch.randn(4, 8)).square().sum().backward()
full = torch.nn.utils.get_total_norm([p.grad.full_tensor() for p in m.parameters()]).item()
got = clip_grad_norm(m.parameters(), 0.5)
after = torch.nn.utils.get_total_norm([p.grad.full_tensor() for p in m.parameters()]).item()
with open(f'{sys.argv[2]}/rank{dist.get_rank()}.txt', 'w') as f:  # ranks' prints interleave
    f.write(f'{full} {got} {after}')
dist.destroy_process_group()
"""


def test_fsdp_grad_norm_is_the_whole_gradients_on_every_rank(tmp_path):
    """Under FSDP2 the step's grad_norm (logged by rank 0; tested for finiteness by every rank) is
    the norm of the whole gradient, not of one rank's shard: torch before 2.11 returns a partial
    norm whose .item() is the shard's alone (there this fails with .item(); 2.11 on already
    reduces it). The clip brings the whole gradient to the bound."""
    script = tmp_path / 'norm.py'
    script.write_text(NORM_SCRIPT)
    p = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone',
                        '--nproc_per_node=2', str(script), str(ROOT), str(tmp_path)],
                       cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [(tmp_path / f'rank{r}.txt').read_text().split() for r in (0, 1)]
    for full, got, after in (map(float, r) for r in rows):
        assert full > 1 and math.isclose(got, full, rel_tol=1e-6), (full, got)
        assert math.isclose(after, 0.5, rel_tol=1e-5), after


# beta: the reference is the adapters-off model; export_best: the merged weights and the adapters
# of the best evaluation (FSDP: gathered from the shards, rank 0's verdict shared)
LORA = ['--lora_rank=4', '--lora_alpha=8', '--lr=2e-2', '--beta=0.05', '--eval_every=1',
        '--export_best=eval/pass@1', '--eval_samples=2', "--eval_tasks=['grpo_test_task:parity']"]


@pytest.fixture(scope='module')
def one_process_lora(tmp_path_factory):
    out = tmp_path_factory.mktemp('one_process_lora')
    run(out, 0, *LORA)
    return out


@pytest.mark.parametrize('fsdp', [False, True])
def test_two_ranks_with_lora_match_one_process(one_process_lora, tmp_path, fsdp):
    """LoRA (frozen base, adapters trained, KL reference = adapters off): DDP reduces the adapters'
    gradients only; FSDP2 shards base and adapters alike, and its sampler (always a copy) gets the
    merged weights gathered."""
    run(tmp_path, 2, *LORA, f'--fsdp={fsdp}')
    # FSDP2 sums the gradients in another order (reduce-scatter of sharded base and adapters): the
    # same completions, and by step 3 AdamW's normalisation has carried that rounding to 1.5e-5 in
    # the grad norm (relative) and 7.6e-5 in the weights on these draws; DDP stays within 1e-5
    assert_same_run(one_process_lora, tmp_path, f"{'FSDP2' if fsdp else 'DDP'} with LoRA, 2 ranks",
                    tol=2e-4 if fsdp else 1e-5)
    assert all('.lora_' in k for k in weights(tmp_path, 3)), "a LoRA checkpoint holds adapters only"
    if not fsdp:  # each rank's sampled evaluation of its share, reduced: the one process's numbers
        # (the parity set's grade passes about half of a random model's completions)
        names = [f'eval/parity/{k}@2' for k in ('pass', 'mean', 'maj')]
        sampled = [[[r[k] for k in names] for r in metrics(d)] for d in (one_process_lora, tmp_path)]
        assert sampled[0] == sampled[1] and 0 < sampled[0][-1][1] < 1, sampled
    best = [json.load(open(d / 'hf_best' / 'grpo_run.json')) for d in (one_process_lora, tmp_path)]
    assert [(b['step'], b['best']) for b in best] == [(best[0]['step'], best[0]['best'])] * 2, best
    assert (tmp_path / 'lora_best' / 'adapter_config.json').exists()


def test_two_fsdp_ranks_with_a_bf16_lora_base_match_one_process(tmp_path):
    """A bf16 LoRA base (lora_base_dtype='auto' on a bf16 snapshot) under FSDP2: the frozen base
    sharded in bf16, the adapters in fp32, each gathered in its own dtype; the run equals one
    process whose base is fp32 (a bf16 snapshot: the same matmuls)."""
    from test_lora import write_base
    snap = write_base(tmp_path / 'snap', dtype=torch.bfloat16)
    args = [snap, '--dtype=bfloat16', *LORA[:4]]
    run(tmp_path / 'one', 0, *args, '--lora_base_dtype=float32')
    run(tmp_path / 'two', 2, *args, '--fsdp=True')  # 'auto': bf16, the snapshot's own dtype
    assert_same_run(tmp_path / 'one', tmp_path / 'two', 'FSDP2 with a bf16 LoRA base, 2 ranks', tol=2e-4)


def test_mini_batches_and_entropy_cut_on_two_ranks_match_one_process(tmp_path):
    """mini_batches=2 x num_iterations=2: each mini-batch holds a group of each rank (dealt round
    robin); its optimizer step all-reduces its own gradient; the clip statistics are summed over
    the ranks. top_entropy_quantile: the entropy cut is taken over both ranks' tokens, the
    zero-spread groups' too (a coin-flip reward: filter_zero_std skips some on one rank only);
    so are Clip-Cov's tokens (each rank marks its own from the draw over all of them)."""
    args = ['--mini_batches=2', '--num_iterations=2', '--top_entropy_quantile=0.5', '--group_size=2',
            "--rewards=[{'name': 'grpo_test_rewards:first_char_even'}]", '--loss_type=clip_cov',
            '--cov_ratio=0.3', '--clip_cov_bounds=(-9.0, 9.0)']
    one, two = tmp_path / 'one', tmp_path / 'two'
    run(one, 0, *args)
    run(two, 2, *args)
    assert_same_run(one, two, 'DDP with 2 mini-batches, 2 ranks')
    assert any(0 < r['frac_zero_std'] < 1 for r in metrics(one)[1:]), metrics(one)[1:]
    for a, b in zip(metrics(one)[1:], metrics(two)[1:]):
        for k in ('clip/low_frac', 'clip/high_frac', 'ratio/mean', 'kl_old_new', 'entropy_cut',
                  'cov/selected_frac'):
            assert (k in a) == (k in b), (a['step'], k)  # a step of equal rewards logs none
            assert math.isclose(a.get(k, 0), b.get(k, 0), rel_tol=1e-4, abs_tol=1e-6), \
                (a['step'], k, a.get(k), b.get(k))


def test_gdpo_sapo_masking_and_dropping_on_two_ranks_match_one_process(tmp_path):
    """advantage='gdpo' over two rewards (each normalised over the whole step's groups, every
    rank's), SAPO with the off-policy mask over two iterations (its share summed over the ranks),
    drop_easy (the set left out, the same on every rank, steers the next draws) and micro-batches
    cut by a token budget (each rank cuts its own rows; the ranks with fewer passes pad): the same
    run as one process."""
    args = ['--advantage=gdpo', '--loss_type=sapo', '--off_policy_mask=1e-3', '--num_iterations=2',
            '--drop_easy=0.5', '--lr=3e-2', '--group_size=2', '--micro_batch_tokens=150',
            "--rewards=[{'name': 'grpo_test_rewards:first_char_even'}, "
            "{'name': 'grpo_test_rewards:digit_fraction', 'weight': 0.5}]"]
    one, two = tmp_path / 'one', tmp_path / 'two'
    run(one, 0, *args)
    run(two, 2, *args)
    assert_same_run(one, two, 'DDP, 2 ranks, gdpo + sapo + off_policy_mask + drop_easy + tokens')
    ra, rb = metrics(one)[1:], metrics(two)[1:]
    # rows of 80-100 tokens: one a pass (or one packed group), more passes than 4 rows a pass
    assert all(r['micro_batches'] > math.ceil(r['rows_trained'] / 4) for r in ra), ra

    assert [r['data/dropped'] for r in ra] == [r['data/dropped'] for r in rb], (ra, rb)
    assert ra[-1]['data/dropped'] > 0, "nothing was dropped: the test tests less than it says"
    for a, b in zip(ra, rb):
        assert math.isclose(a['off_policy/masked_frac'], b['off_policy/masked_frac'],
                            abs_tol=1e-6), a['step']


def test_dynamic_sampling_on_two_ranks_matches_one_process(tmp_path):
    """Refill rounds split each round's prompts between the ranks, and a kept group trains on the
    rank that sampled it (it holds the sampler's log-probs): the same prompts, completions and
    weights as one process. The problems are a mixture (mix_tasks), its per-task metrics over every
    round's prompts the same too."""
    args = ['--group_size=2', '--dynamic_sampling=4',
            "--rewards=[{'name': 'grpo_test_rewards:first_char_even'}]",
            "--mix_tasks=[('tests/grpo_test_task.py', '', 2.0)]"]
    run(tmp_path / 'one', 0, *args)
    run(tmp_path / 'two', 2, *args)
    assert_same_run(tmp_path / 'one', tmp_path / 'two', 'DDP, 2 ranks, dynamic sampling')
    rows = metrics(tmp_path / 'two')
    assert any(r.get('dynamic/rounds', 0) > 1 for r in rows), "no refill happened"
    drawn = [r.get('mix/grpo_test_task/prompts', 0) + r.get('mix/arith/prompts', 0) for r in rows[1:]]
    assert drawn == [r['dynamic/prompts'] for r in rows[1:]] and any(
        'mix/grpo_test_task/prompts' in r for r in rows), rows


def worker_pids(pid):
    """torchrun's workers: its children (each started by setsid, so not in torchrun's process
    group)."""
    kids = []
    for stat in Path('/proc').glob('[0-9]*/stat'):
        try:
            # the field after the state is the parent
            if int(stat.read_text().rsplit(')', 1)[1].split()[1]) == pid:
                kids.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue  # a process that ended while we looked
    return kids


def alive(pid):
    try:
        state = Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1].split()[0]
        return state != 'Z'  # a zombie is dead
    except FileNotFoundError:
        return False


def test_sigkill_of_all_ranks_then_resume(one_process, tmp_path):
    """Every process of a 2-rank run SIGKILLed after its step-2 checkpoint (stalled in step 3, so
    the kill cannot come too late); the same command, minus the stall, resumes and ends where one
    uninterrupted process does."""
    proc = subprocess.Popen(cmd(tmp_path, 2, '--fault_stall_step=3', '--fault_stall_s=120'),
                            cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 120
    while not (tmp_path / 'ckpt_0000002.pt').exists():
        assert time.time() < deadline and proc.poll() is None, "the 2-rank run never reached step 2"
        time.sleep(0.05)
    kids = worker_pids(proc.pid)
    assert len(kids) == 2, f"expected 2 worker processes under torchrun, found {kids}"
    os.killpg(proc.pid, signal.SIGKILL)
    for k in kids:
        os.kill(k, signal.SIGKILL)
    proc.wait()
    while any(alive(k) for k in kids):
        time.sleep(0.05)
    assert not (tmp_path / 'ckpt_0000003.pt').exists(), "killed too late to test anything"
    p = run(tmp_path, 2)
    assert 'resume:' in p.stdout, p.stdout[-2000:]
    assert_same_run(one_process, tmp_path, 'DDP after SIGKILL + resume')


def test_sigterm_to_torchrun_saves_on_every_rank_then_resumes(one_process, tmp_path):
    """SIGTERM to torchrun reaches both ranks; they finish the step, save it, exit with 128+15 and
    no abort at teardown (gloo); the same command, minus the stall, resumes and ends where one
    uninterrupted process does."""
    proc = subprocess.Popen(cmd(tmp_path, 2, '--fault_stall_step=2', '--fault_stall_s=3'),
                            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    deadline = time.time() + 120
    while not (tmp_path / 'ckpt_0000001.pt').exists():
        assert time.time() < deadline and proc.poll() is None, "the 2-rank run never reached step 1"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0, "a run stopped by a signal must not exit 0"
    assert 'signal 15: checkpoint saved at step 2' in out, out[-2000:] + err[-3000:]
    assert 'terminate called' not in err and 'SIGABRT' not in err, err[-3000:]
    assert (tmp_path / 'ckpt_0000002.pt').exists() and not (tmp_path / 'ckpt_0000003.pt').exists()
    p = run(tmp_path, 2)
    assert 'resume:' in p.stdout, p.stdout[-2000:]
    assert_same_run(one_process, tmp_path, 'DDP after SIGTERM + resume')


def test_one_process_on_a_numbered_gpu_makes_it_the_current_device(monkeypatch):
    """--device=cuda:1 without torchrun: GPU 1 becomes torch's current device, the one CUDA's RNG
    state (saved in checkpoints), the memory statistics, CUDA graphs and Triton's launches use;
    without it they would use GPU 0 while the tensors live on GPU 1."""
    import parallel
    chosen = []
    monkeypatch.delenv('RANK', raising=False)
    monkeypatch.setattr(torch.cuda, 'set_device', chosen.append)
    assert parallel.setup('cuda:1', 4, False) == (0, 1, 'cuda:1') and chosen == ['cuda:1']
    assert parallel.setup('cpu', 4, False) == (0, 1, 'cpu') and chosen == ['cuda:1']


def test_batch_not_divisible_by_ranks_is_a_clear_error(tmp_path):
    p = run(tmp_path, 2, '--batch_prompts=3', check=False)
    assert p.returncode != 0, p.stderr[-2000:]
    assert 'batch_prompts=3' in p.stderr and 'divisible' in p.stderr, p.stderr[-2000:]


def test_reference_sync_with_optimizer_reset_on_two_fsdp_ranks_matches_one_process(tmp_path):
    """ref_sync_every with ref_sync_reset_optimizer under FSDP2: the reference (a whole copy on each
    rank) moves to the gathered policy and every rank zeroes its shard of AdamW's state in place (a
    cleared state would make DCP's checkpoint path invent a step): the same run as one process.
    The step after a reset is a new AdamW's first, about lr * sign(gradient), which turns FSDP's
    reduction rounding on near-zero gradients into whole steps: at lr 3e-2 the weights then
    differed by 7e-4 (1e-5 without the reset), so this runs at TINY's 1e-3, within the LoRA FSDP
    test's tolerance."""
    args = ['--beta=0.05', '--ref_sync_every=2', '--ref_sync_reset_optimizer=True']
    one, two = tmp_path / 'one', tmp_path / 'two'
    run(one, 0, *args)
    run(two, 2, *args, '--fsdp=True')
    assert_same_run(one, two, 'FSDP2, 2 ranks, reference sync with optimizer reset', tol=2e-4)
    state = torch.load(two / 'ckpt_0000002.pt', weights_only=False)['optimizer']['state']
    assert state and all(t.count_nonzero() == 0 for s in state.values() for t in s.values())
