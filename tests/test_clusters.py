"""What `initialize` starts with under each scheduler (docs/guides/clusters.md),
from the scheduler's environment variables simulated here: the settings
redeqx resolves (`resolve`, which reads the environment and starts
nothing), with arguments and ``REDEQX_*`` variables still first."""

import pytest

from redeqx.run._clusters import first_host
from redeqx.run._settings import DEFAULT_PORT, cluster_hint, resolve

SLURM_2_NODES_1_TASK_EACH = {  # sbatch --nodes=2 --ntasks-per-node=1, then srun, on the second node
    "SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "gpu[017-018]", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
    "SLURM_LOCALID": "0", "SLURM_STEP_NUM_NODES": "2",
}
SLURM_2_NODES_8_TASKS_EACH = {  # --ntasks-per-node=8 (one task a GPU): task 11 is the fourth on the second node
    "SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "gpu[017,020]", "SLURM_NTASKS": "16", "SLURM_PROCID": "11",
    "SLURM_LOCALID": "3", "SLURM_STEP_NUM_NODES": "2",
}
JOBSET = {  # a JobSet "train" with one replicated job "workers", pod 3, the manifest giving the count
    "JOBSET_NAME": "train", "REPLICATED_JOB_NAME": "workers", "JOB_INDEX": "0", "JOB_COMPLETION_INDEX": "3",
    "REDEQX_N_PROCESSES": "4", "KUBERNETES_SERVICE_HOST": "10.0.0.1",
}
INDEXED_JOB = {  # an indexed Job with a headless service "jax" and the manifest's address and count
    "JOB_COMPLETION_INDEX": "2", "REDEQX_HOST0_ADDRESS": "train-0.jax", "REDEQX_N_PROCESSES": "4",
    "KUBERNETES_SERVICE_HOST": "10.0.0.1",
}
TPU_VM = {"TPU_WORKER_HOSTNAMES": "t1v-n-0,t1v-n-1,t1v-n-2,t1v-n-3", "TPU_WORKER_ID": "2", "CLOUD_TPU_TASK_ID": "2"}


@pytest.fixture
def environment(monkeypatch):
    """Sets a scheduler's variables in an environment cleared of every other one's."""
    import os

    for name in list(os.environ):
        if name.startswith(("SLURM_", "REDEQX_", "JOB", "TPU_", "CLOUD_TPU", "OMPI_", "KUBERNETES_", "JAX_COORD")):
            monkeypatch.delenv(name)

    def set_to(variables):
        for name, value in variables.items():
            monkeypatch.setenv(name, value)

    return set_to


def resolved(**arguments):
    names = ("host0_address", "host0_port", "n_processes", "process_id", "local_device_ids", "timeout",
             "heartbeat_timeout")
    return resolve(*(arguments.get(n) for n in names))


def test_slurm_one_task_a_node_takes_every_device_of_its_node(environment):
    environment(SLURM_2_NODES_1_TASK_EACH)
    c = resolved()
    assert (c.host0_address, c.host0_port, c.n_processes, c.process_id) == ("gpu017", 61440 + 4242 % 4096, 2, 1)
    assert c.local_device_ids is None
    assert cluster_hint() == "SLURM"


def test_slurm_one_task_a_gpu_takes_its_own(environment):
    environment(SLURM_2_NODES_8_TASKS_EACH)
    c = resolved()
    assert (c.host0_address, c.n_processes, c.process_id, c.local_device_ids) == ("gpu017", 16, 11, (3,))


def test_slurm_port_from_jax_coordinator_port_and_arguments_first(environment):
    environment({**SLURM_2_NODES_1_TASK_EACH, "JAX_COORDINATOR_PORT": "23456"})
    assert resolved().host0_port == 23456
    c = resolved(host0_address="10.1.1.1", process_id=0)
    assert (c.host0_address, c.host0_port, c.process_id, c.n_processes) == ("10.1.1.1", None, 0, 2)
    assert c.local_device_ids is None  # another address than SLURM's: its device rule is not applied


def test_slurm_without_a_job_step_is_left_alone(environment):
    """The batch script itself (no srun): no step node list, so nothing is read
    (the script would otherwise wait for tasks that never start)."""
    environment({k: v for k, v in SLURM_2_NODES_1_TASK_EACH.items() if k != "SLURM_STEP_NODELIST"})
    c = resolved()
    assert (c.host0_address, c.n_processes, c.process_id) == (None, None, None)


def test_kubernetes_jobset_and_indexed_job(environment):
    environment(JOBSET)
    c = resolved()
    assert (c.host0_address, c.host0_port, c.n_processes, c.process_id) == ("train-workers-0-0.train", None, 4, 3)
    assert cluster_hint() is None  # Kubernetes alone says nothing of several processes


def test_kubernetes_indexed_job_with_the_manifest_address(environment):
    environment(INDEXED_JOB)
    c = resolved()
    assert (c.host0_address, c.n_processes, c.process_id) == ("train-0.jax", 4, 2)
    assert (c.host0_port or DEFAULT_PORT) == DEFAULT_PORT


def test_cloud_tpu_is_left_to_jax(environment):
    environment(TPU_VM)
    c = resolved()
    assert (c.host0_address, c.n_processes, c.process_id, c.local_device_ids) == (None, None, None, None)
    assert cluster_hint() == "Cloud TPU"


def test_a_bad_scheduler_variable_is_named(environment):
    environment({**SLURM_2_NODES_1_TASK_EACH, "SLURM_PROCID": "one"})
    with pytest.raises(ValueError, match="SLURM_PROCID='one'"):
        resolved()


@pytest.mark.parametrize("nodes, first", [("node001", "node001"), ("node001,host2", "node001"),
                                          ("node[001-015],host2", "node001"), ("node[007,001-005]", "node007"),
                                          ("a-b[3]", "a-b3")])
def test_first_host_of_a_node_list(nodes, first):
    assert first_host(nodes) == first
