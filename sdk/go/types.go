// SPDX-License-Identifier: Apache-2.0

package opendsec

import "encoding/json"

// RunArgs says what sandbox to create. Zero values take the server's defaults.
type RunArgs struct {
	// Image is a reference such as "root/base:latest" (the default) or "root/py:3.11".
	Image string `json:"image"`
	// Backend is "container" (the default), "vm" (QEMU) or "microvm" (Firecracker).
	Backend            string  `json:"backend,omitempty"`
	CPUCoresLimit      float64 `json:"cpu_cores_limit,omitempty"`
	MemoryLimitMB      int64   `json:"memory_limit_mb,omitempty"`
	DiskLimitMB        int64   `json:"disk_limit_mb,omitempty"`
	PidsLimit          int64   `json:"pids_limit,omitempty"`
	TTLSeconds         int64   `json:"ttl_seconds,omitempty"`
	IdleTimeoutSeconds int64   `json:"idle_timeout_seconds,omitempty"`
	// OnTimeout is what the TTL's end does: "stop" (default), "pause" or "pause_to_disk".
	OnTimeout string `json:"on_timeout,omitempty"`
	// AutoResume resumes a paused sandbox on the next request to one of its ports.
	AutoResume *bool             `json:"auto_resume,omitempty"`
	Labels     map[string]string `json:"labels,omitempty"`
	Env        map[string]string `json:"env,omitempty"`
	// Project is the project whose quota the sandbox counts against (default: the key's).
	Project string `json:"project,omitempty"`
	// NetworkRules says what the sandbox may reach; egress is closed otherwise. Keys are
	// service names ("pypi"), domains ("*.example.com") or IPv4 CIDRs with an optional
	// port ("203.0.113.0/24:443").
	NetworkRules map[string]bool `json:"network_rules,omitempty"`
	// EgressHeaders are headers the node sets on the sandbox's requests to a host (which
	// must be allowed too); the sandbox never holds their values.
	EgressHeaders map[string]map[string]string `json:"egress_headers,omitempty"`
	// Network "none" gives the sandbox loopback only.
	Network string        `json:"network,omitempty"`
	Volumes []VolumeMount `json:"volumes,omitempty"`
}

// VolumeMount mounts a volume (by id or name) at Path.
type VolumeMount struct {
	Volume   string `json:"volume"`
	Path     string `json:"path"`
	ReadOnly bool   `json:"read_only,omitempty"`
}

// Limits are a sandbox's resource limits.
type Limits struct {
	CPUCores float64 `json:"cpu_cores"`
	MemoryMB uint64  `json:"memory_mb"`
	DiskMB   uint64  `json:"disk_mb"`
	Pids     uint64  `json:"pids"`
}

// NetworkInfo is a sandbox's network: Mode "rules" (egress per Rules) or "none".
type NetworkInfo struct {
	Mode          string                       `json:"mode"`
	Address       string                       `json:"address,omitempty"`
	Rules         map[string]bool              `json:"rules"`
	EgressHeaders map[string]map[string]string `json:"egress_headers,omitempty"`
}

// SandboxInfo is a sandbox as the API shows it.
type SandboxInfo struct {
	ID      string `json:"id"`
	Edge    string `json:"edge"`
	Backend string `json:"backend"`
	Image   string `json:"image"`
	// State is "creating", "running", "paused", "stopping" or "stopped".
	State              string            `json:"state"`
	Limits             Limits            `json:"limits"`
	CreatedAtMs        uint64            `json:"created_at_ms"`
	ExpiresAtMs        uint64            `json:"expires_at_ms"`
	IdleTimeoutSeconds *uint64           `json:"idle_timeout_seconds,omitempty"`
	Labels             map[string]string `json:"labels"`
	OOMKills           uint64            `json:"oom_kills"`
	ForkedFrom         string            `json:"forked_from,omitempty"`
	Project            string            `json:"project"`
	// PortToken opens the sandbox's ports without an API key (see Sandbox.PortURL).
	PortToken    string        `json:"port_token"`
	Network      NetworkInfo   `json:"network"`
	PausedToDisk bool          `json:"paused_to_disk"`
	MovedFrom    string        `json:"moved_from,omitempty"`
	FromPool     string        `json:"from_pool,omitempty"`
	Volumes      []VolumeMount `json:"volumes,omitempty"`
}

// ExecResult is what a finished command did. ExitCode is 128 + the signal number when a
// signal ended it.
type ExecResult struct {
	Stdout          string `json:"stdout"`
	Stderr          string `json:"stderr"`
	ExitCode        int    `json:"exit_code"`
	Signal          *int   `json:"signal,omitempty"`
	TimedOut        bool   `json:"timed_out"`
	OOMKilled       bool   `json:"oom_killed"`
	StdoutTruncated bool   `json:"stdout_truncated"`
	StderrTruncated bool   `json:"stderr_truncated"`
	DurationMs      uint64 `json:"duration_ms"`
}

// SessionResult is a session command's result: State "running" (output so far, no exit
// code yet) or "done".
type SessionResult struct {
	ExecResult
	CommandID json.RawMessage `json:"command_id"`
	State     string          `json:"state"`
	// SessionRestarted says the shell was restarted after a timeout.
	SessionRestarted bool `json:"session_restarted"`
}

// Done says the command has finished.
func (r *SessionResult) Done() bool { return r.State == "done" || r.State == "" }

// CommitResult is the image Sandbox.Commit made.
type CommitResult struct {
	Image     string   `json:"image"`
	Digest    string   `json:"digest"`
	Layers    []string `json:"layers"`
	SizeBytes uint64   `json:"size_bytes"`
	PausedMs  uint64   `json:"paused_ms"`
}

// SnapshotInfo is a sandbox's state kept under an id, to start sandboxes from.
type SnapshotInfo struct {
	ID              string            `json:"id"`
	Edge            string            `json:"edge"`
	Source          string            `json:"source"`
	Backend         string            `json:"backend"`
	Image           string            `json:"image"`
	Project         string            `json:"project"`
	Labels          map[string]string `json:"labels"`
	CreatedAtMs     uint64            `json:"created_at_ms"`
	MemoryPreserved bool              `json:"memory_preserved"`
	SizeBytes       uint64            `json:"size_bytes"`
	SourcePausedMs  uint64            `json:"source_paused_ms"`
}

// ProcessInfo is a managed process (running, or one of the last finished).
type ProcessInfo struct {
	Pid         int      `json:"pid"`
	Argv        []string `json:"argv"`
	Tag         string   `json:"tag,omitempty"`
	Cwd         string   `json:"cwd,omitempty"`
	Pty         bool     `json:"pty"`
	Running     bool     `json:"running"`
	ExitCode    *int     `json:"exit_code,omitempty"`
	StartedAtMs uint64   `json:"started_at_ms"`
}

// FileInfo is a file's entry from Stat or List. Type is "file", "dir" or "symlink".
type FileInfo struct {
	Path     string            `json:"path"`
	Name     string            `json:"name"`
	Type     string            `json:"type"`
	Size     uint64            `json:"size"`
	Mode     uint32            `json:"mode"`
	UID      uint32            `json:"uid"`
	GID      uint32            `json:"gid"`
	MtimeMs  int64             `json:"mtime_ms"`
	Target   string            `json:"target,omitempty"`
	Metadata map[string]string `json:"metadata,omitempty"`
}

// Quota is a project's limits (nil fields: unchanged or unlimited).
type Quota struct {
	Sandboxes *int64   `json:"sandboxes,omitempty"`
	CPUCores  *float64 `json:"cpu_cores,omitempty"`
	MemoryMB  *int64   `json:"memory_mb,omitempty"`
	DiskMB    *int64   `json:"disk_mb,omitempty"`
}

// Key is an API key as listed or made; Secret (the key itself) is set only in
// CreateKey's answer.
type Key struct {
	ID        string `json:"key_id"`
	Principal string `json:"principal"`
	Project   string `json:"project"`
	// Kind is "human" or "agent".
	Kind      string `json:"kind"`
	CreatedMs uint64 `json:"created_ms,omitempty"`
	Revoked   bool   `json:"revoked,omitempty"`
	Secret    string `json:"key,omitempty"`
}

// Int64 returns a pointer to v, for Quota's fields.
func Int64(v int64) *int64 { return &v }

// Float64 returns a pointer to v, for Quota's fields.
func Float64(v float64) *float64 { return &v }

// Bool returns a pointer to v, for RunArgs.AutoResume.
func Bool(v bool) *bool { return &v }
