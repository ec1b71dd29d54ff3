"""``hetconv train --discover``: the workers found on the LAN, less those named already and
those that refuse this master's token or TLS, joined as they appear while training."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from hetconv.training import train


def train_discovered(
    config, cluster_config, named: list[str], wait: float, cluster_class=None, backend="cpu"
):
    """``hetconv train --discover``: browse the LAN for ``wait`` seconds, say what was found,
    train with it and the ``named`` workers, and keep browsing (joiners and leavers).
    ``cluster_class``: the cluster (default :class:`~hetconv.master.cluster.Cluster`);
    ``backend``: the master's own (``--engine``)."""
    from hetconv.master.cluster import Cluster
    from hetconv.master.discovery import Discovery

    try:
        discovery = Discovery(has_token=cluster_config.token is not None)
    except OSError as e:
        raise OSError(
            f"--discover cannot browse the LAN (multicast DNS): {e}; name workers with --worker"
        ) from None
    try:
        print(f"looking for workers on the LAN (DNS-SD/mDNS) for {wait:g} s ...", flush=True)
        found = _not_named(discovery.wait(wait), named, cluster_config)
        found = _accepting(_answering(found), cluster_config)
        for refusal in discovery.take_refusals():
            print(f"found {refusal.address}, not used: {refusal.reason}")
        for notice in discovery.take_notices():
            print(notice)
        if found:
            listed = "; ".join(w.describe() for w in found)
            print(f"found {len(found)} worker{'s' if len(found) != 1 else ''}: {listed}")
        else:
            other = "other " if named else ""
            print(
                f"found no {other}worker yet; still looking while training (workers join as "
                "they appear)"
            )
        addresses = named + [w.address for w in found]
        if not addresses and not cluster_config.master_compute:
            raise ValueError(
                f"--discover found no worker in {wait:g} s and --no-master-compute leaves "
                "nothing to compute: start workers first, or give --discover-wait more"
            )
        cluster_class = cluster_class or Cluster
        with cluster_class(addresses, backend=backend, config=cluster_config) as cluster:
            cluster.membership.follow(discovery, [w.address for w in found])
            return train(config, cluster)
    finally:
        discovery.close()


def _answering(found) -> list:
    """The workers ``found`` on the LAN that a TCP connection reaches now (tried all at once,
    a second each): the others are not waited for at start but tried while training like
    workers that appear, so advertisements nobody answers at do not hold up the start."""
    from hetconv.master.discovery import JOIN_BOUND, reach

    with ThreadPoolExecutor(JOIN_BOUND) as pool:
        errors = list(pool.map(lambda worker: reach(worker.address), found))
    silent = [w.address for w, error in zip(found, errors, strict=True) if error is not None]
    if silent:
        count = len(silent)
        shown = ", ".join(silent[:3]) + (", ..." if count > 3 else "")
        print(
            f"found {count} more advertised worker{'s' if count != 1 else ''} that nothing "
            f"answers at yet ({shown}): tried while training, each joins when it answers"
        )
    return [w for w, error in zip(found, errors, strict=True) if error is None]


def _accepting(found, cluster_config) -> list:
    """The workers ``found`` on the LAN minus those that refuse this master's token or fail
    its TLS check (another user's workers, or a stranger's), each said. Asked concurrently."""
    from hetconv.master.discovery import JOIN_BOUND

    with ThreadPoolExecutor(JOIN_BOUND) as pool:
        refusals = list(pool.map(lambda worker: _refusal(worker, cluster_config), found))
    kept = []
    for worker, refusal in zip(found, refusals, strict=True):
        if refusal is None:
            kept.append(worker)
        else:
            print(f"found {worker.address}, not used: {refusal}")
    return kept


def _refusal(worker, cluster_config) -> str | None:
    """Why a worker found on the LAN refuses this master (its token, its TLS check), or None."""
    from hetconv.master.client import WorkerAuthError, WorkerClient, WorkerError, WorkerTLSError

    if not worker.token_required and cluster_config.tls_ca is None:
        return None
    client = WorkerClient(
        worker.address, 2.0, token=cluster_config.token, tls_ca=cluster_config.tls_ca
    )
    try:
        client.describe()
    except (WorkerAuthError, WorkerTLSError) as e:
        return str(e)
    except WorkerError:  # not reachable now: the cluster reports it and retries
        pass
    finally:
        client.close()
    return None


def _not_named(found, named: list[str], cluster_config) -> list:
    """The workers ``found`` on the LAN that are not among the ``named`` ones, by address or
    by worker process (the instance id their advertisement carries and Describe returns: a
    worker named as ``localhost:P`` is found at its LAN address), saying which were left."""
    from hetconv.master.client import WorkerClient, WorkerError

    found = [w for w in found if w.address not in named]
    if not found or not named:
        return found
    named_ids = {}
    for address in named:
        client = WorkerClient(
            address, 2.0, token=cluster_config.token, tls_ca=cluster_config.tls_ca
        )
        try:
            named_ids[f"{client.describe().instance_id:016x}"] = address
        except WorkerError:  # not reachable now: the cluster reports it
            pass
        finally:
            client.close()
    kept = []
    for worker in found:
        twin = named_ids.get(worker.properties.get("instance", ""))
        if twin is None:
            kept.append(worker)
        else:
            print(f"found {worker.address}: the worker named as {twin}; using it")
    return kept
