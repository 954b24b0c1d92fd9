-- starckpt control-plane schema, version 1.
-- Written in the common subset of SQLite and PostgreSQL; sql.rs fills in {ID} (checkpoints.id:
-- SQLite's rowid, PostgreSQL's identity column) and {BYTES} (BLOB, BYTEA) per database.

CREATE TABLE IF NOT EXISTS schema_version (
    version INTEGER NOT NULL
);

CREATE TABLE IF NOT EXISTS targets (
    target_id         TEXT PRIMARY KEY,
    data_address      TEXT NOT NULL,
    capacity_bytes    BIGINT NOT NULL,
    used_bytes        BIGINT NOT NULL,
    chunk_count       BIGINT NOT NULL DEFAULT 0,
    registered_at_ms  BIGINT NOT NULL,
    last_heartbeat_ms BIGINT NOT NULL,
    -- '' = a failure domain of its own. (Added in schema version 2; see sqlite.rs.)
    failure_domain    TEXT NOT NULL DEFAULT '',
    -- '' = no RDMA. (Added in schema version 3.)
    rdma_device       TEXT NOT NULL DEFAULT ''
);

-- Writer leases: one row per run that ever wrote a job. The job's current lease is its highest
-- epoch; a run id once superseded can never take the lease back, nor can a new one that started
-- before the holder (fencing of zombie writers).
CREATE TABLE IF NOT EXISTS leases (
    job            TEXT NOT NULL,
    run_id         TEXT NOT NULL,
    epoch          BIGINT NOT NULL,
    acquired_at_ms BIGINT NOT NULL,
    -- When the run's first asking process started (Unix ms); 0: not said.
    started_at_ms  BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (job, run_id),
    UNIQUE (job, epoch)
);

CREATE TABLE IF NOT EXISTS checkpoints (
    id              {ID},
    job             TEXT NOT NULL,
    step            BIGINT NOT NULL,
    state           TEXT NOT NULL CHECK (state IN ('pending', 'committed', 'aborted', 'deleted')),
    world_size      INTEGER NOT NULL,
    -- Writer lease epoch the checkpoint was begun under (leases.epoch).
    epoch           BIGINT NOT NULL,
    parts_committed INTEGER NOT NULL DEFAULT 0,
    total_bytes     BIGINT NOT NULL DEFAULT 0,
    -- Bytes actually uploaded (total_bytes less deduplicated chunks), as the writers reported.
    written_bytes   BIGINT NOT NULL DEFAULT 0,
    file_count      BIGINT NOT NULL DEFAULT 0,
    created_at_ms   BIGINT NOT NULL,
    committed_at_ms BIGINT,
    ended_at_ms     BIGINT
);

-- At most one live (pending or committed) checkpoint per (job, step).
CREATE UNIQUE INDEX IF NOT EXISTS checkpoints_live_step
    ON checkpoints (job, step) WHERE state IN ('pending', 'committed');
-- `latest` is one index seek: highest committed step of a job.
CREATE INDEX IF NOT EXISTS checkpoints_by_state ON checkpoints (job, state, step);
-- The reaper's scan for pending checkpoints past their timeout.
CREATE INDEX IF NOT EXISTS checkpoints_pending_age ON checkpoints (state, created_at_ms);

CREATE TABLE IF NOT EXISTS parts (
    checkpoint_id   BIGINT NOT NULL REFERENCES checkpoints (id),
    rank            INTEGER NOT NULL,
    -- prost-encoded starckpt.control.v1.Manifest, validated before insertion and after reading.
    manifest        {BYTES} NOT NULL,
    total_bytes     BIGINT NOT NULL,
    written_bytes   BIGINT NOT NULL,
    file_count      BIGINT NOT NULL,
    committed_at_ms BIGINT NOT NULL,
    PRIMARY KEY (checkpoint_id, rank)
);

-- A job's retention policy (absent: keep every checkpoint). 0 turns a rule off. Applied when a
-- checkpoint of the job commits (same transaction) and when the policy is set.
CREATE TABLE IF NOT EXISTS retention (
    job           TEXT PRIMARY KEY,
    keep_last     BIGINT NOT NULL,
    keep_every    BIGINT NOT NULL,
    updated_at_ms BIGINT NOT NULL
);

-- A job's replication factor (absent: the control plane's default).
CREATE TABLE IF NOT EXISTS replication (
    job           TEXT PRIMARY KEY,
    replicas      INTEGER NOT NULL,
    updated_at_ms BIGINT NOT NULL
);

-- Committed checkpoints whose every chunk and manifest is in the object-store tier (tier.rs).
CREATE TABLE IF NOT EXISTS tiered (
    checkpoint_id BIGINT PRIMARY KEY REFERENCES checkpoints (id),
    tiered_at_ms  BIGINT NOT NULL
);

-- The tier's sweeps, begun and finished (one row): a checkpoint is marked tiered only if no sweep
-- was running when its upload looked at the tier, nor began since (tier.rs).
CREATE TABLE IF NOT EXISTS tier_sweeps (
    id       INTEGER PRIMARY KEY CHECK (id = 1),
    started  BIGINT NOT NULL,
    finished BIGINT NOT NULL
);

-- The last re-replication pass of the cluster (one row; one control plane at a time runs them):
-- when it finished and how many chunks it left short of copies, for `starckpt status`.
CREATE TABLE IF NOT EXISTS repair_passes (
    id                     INTEGER PRIMARY KEY CHECK (id = 1),
    finished_at_ms         BIGINT NOT NULL,
    still_under_replicated BIGINT NOT NULL
);

-- The control planes serving this database (several share a PostgreSQL one), by host and port,
-- with the settings they must agree on (service.rs `join`) and when each was last seen.
CREATE TABLE IF NOT EXISTS control_planes (
    id                 TEXT PRIMARY KEY,
    pending_timeout_ms BIGINT NOT NULL,
    gc_grace_ms        BIGINT NOT NULL,
    seen_at_ms         BIGINT NOT NULL,
    -- What callers and targets must prove (store.rs `ControlPlaneMember::security`); '' unknown.
    security           TEXT NOT NULL DEFAULT '',
    -- The object-store tier it uses (store.rs `ControlPlaneMember::tier`); '' unknown.
    tier               TEXT NOT NULL DEFAULT ''
);

-- Tags pin committed checkpoints: retention never deletes a tagged one.
CREATE TABLE IF NOT EXISTS tags (
    checkpoint_id BIGINT NOT NULL REFERENCES checkpoints (id),
    tag           TEXT NOT NULL,
    PRIMARY KEY (checkpoint_id, tag)
);

-- Drafts: checkpoints a mount is writing in place, each writer's record of its closed files
-- (proto/src/draft.rs). Their chunks are live for GC; a record not put again within the draft
-- TTL is forgotten (gc.rs). (Added in schema version 7.)
CREATE TABLE IF NOT EXISTS drafts (
    job           TEXT NOT NULL,
    name          TEXT NOT NULL,
    writer        TEXT NOT NULL,
    -- prost-encoded starckpt.control.v1.Manifest, validated before insertion and after reading.
    manifest      {BYTES} NOT NULL,
    file_count    BIGINT NOT NULL,
    total_bytes   BIGINT NOT NULL,
    updated_at_ms BIGINT NOT NULL,
    PRIMARY KEY (job, name, writer)
);
CREATE INDEX IF NOT EXISTS drafts_by_writer ON drafts (writer, job, name);
CREATE INDEX IF NOT EXISTS drafts_by_age ON drafts (updated_at_ms);

-- Job files: files directly in a job's directory that are no checkpoint (Lightning's last.ckpt,
-- DeepSpeed's `latest`), written through a mount (proto/src/draft.rs). One file each, replaced
-- whole; their chunks are live for GC until the row is dropped. (Added in schema version 8.)
CREATE TABLE IF NOT EXISTS job_files (
    job           TEXT NOT NULL,
    name          TEXT NOT NULL,
    -- prost-encoded starckpt.control.v1.Manifest of the one file, validated like a draft's.
    manifest      {BYTES} NOT NULL,
    size_bytes    BIGINT NOT NULL,
    updated_at_ms BIGINT NOT NULL,
    PRIMARY KEY (job, name)
);
