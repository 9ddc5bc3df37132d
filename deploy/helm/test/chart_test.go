// SPDX-License-Identifier: AGPL-3.0-only

// Package test renders the opendsec Helm chart (deploy/helm/opendsec) with a helm built
// from the Go modules pinned in go.mod, decodes every rendered object strictly into its
// Kubernetes type, and checks what the fleet depends on. No Kubernetes cluster is involved.
package test

import (
	"bytes"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/BurntSushi/toml"
	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
)

const (
	chartDir     = "../opendsec"
	manifestPath = "../../k8s/opendsec.yaml"
	release      = "opendsec"
	namespace    = "opendsec"
	prefix       = "opendsec" // the chart's fullname for release "opendsec"
	edgeConfigRS = "../../../crates/edge/src/config.rs"
	updateEnv    = "OPENDSEC_UPDATE_MANIFESTS"
)

// manifestHeader heads deploy/k8s/opendsec.yaml; the rest of the file is helm's output.
const manifestHeader = `# SPDX-License-Identifier: AGPL-3.0-only
# OpenDsec as plain Kubernetes manifests: the output, unedited below this header, of
#
#   helm template opendsec deploy/helm/opendsec --namespace opendsec
#
# with the chart's default values (helm v4.3.2). Do not edit it by hand: deploy/helm/test
# fails when it differs from the chart's render. Regenerate it with
#
#   cd deploy/helm/test && ` + updateEnv + `=1 go test -count=1 -run 'TestChart/committed' ./...
#
# Its one edge is the chart's example (edge1 on node "node1" at 10.0.0.41): render your own
# with your nodes in edge.nodes (helm template ... -f my-values.yaml, deploy/helm/README.md)
# rather than editing this file, since an edge is named in many places (configs, the
# DaemonSet's node affinity, the certificate Job). Apply: kubectl create namespace
# opendsec && kubectl apply -f <file>.
`

// render is one set of values the chart is rendered with.
type render struct {
	name       string
	valueFiles []string
	set        []string
	// What the values say, as the checks expect it.
	iam, apiservers int
	mode            string // "job" or "certManager"
	edges           []edgeNode
	kvm             bool
	imageClaim      string // "": the hostPath store
}

type edgeNode struct{ name, node, address string }

var (
	defaultEdges   = []edgeNode{{"edge1", "node1", "10.0.0.41"}}
	multinodeEdges = []edgeNode{{"sbxa1", "sbx-a1", "10.20.0.11"}, {"sbxa2", "sbx-a2", "10.20.0.12"}, {"sbxa3", "sbx-a3", "10.20.0.13"}}
	multinode      = chartDir + "/values-multinode.yaml"
)

var renders = []render{
	{name: "default", iam: 3, apiservers: 2, mode: "job", edges: defaultEdges},
	{name: "default-certManager", set: []string{"certificates.mode=certManager"}, iam: 3, apiservers: 2, mode: "certManager", edges: defaultEdges},
	{name: "multinode", valueFiles: []string{multinode}, iam: 5, apiservers: 3, mode: "certManager", edges: multinodeEdges, kvm: true, imageClaim: "dsec-images"},
	{name: "multinode-job", valueFiles: []string{multinode}, set: []string{"certificates.mode=job"}, iam: 5, apiservers: 3, mode: "job", edges: multinodeEdges, kvm: true, imageClaim: "dsec-images"},
}

func (r render) args() []string {
	var a []string
	for _, f := range r.valueFiles {
		a = append(a, "--values", f)
	}
	for _, s := range r.set {
		a = append(a, "--set", s)
	}
	return a
}

// helmTool is a helm built from the module graph of go.mod, with its own empty homes.
type helmTool struct{ bin, home string }

func buildHelm(t *testing.T) helmTool {
	t.Helper()
	goBin, err := exec.LookPath("go")
	if err != nil {
		goBin = filepath.Join(runtime.GOROOT(), "bin", "go")
	}
	dir := t.TempDir()
	bin := filepath.Join(dir, "helm")
	start := time.Now()
	// The module's own go.mod and go.sum pin helm and everything it links (tools.go).
	cmd := exec.Command(goBin, "build", "-o", bin, "helm.sh/helm/v4/cmd/helm")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build helm: %v\n%s", err, out)
	}
	t.Logf("built helm (helm.sh/helm/v4 of go.mod) in %s", time.Since(start).Round(time.Millisecond))
	return helmTool{bin: bin, home: t.TempDir()}
}

func (h helmTool) run(args ...string) ([]byte, []byte, error) {
	cmd := exec.Command(h.bin, args...)
	cmd.Env = append(os.Environ(),
		"HELM_CACHE_HOME="+filepath.Join(h.home, "cache"),
		"HELM_CONFIG_HOME="+filepath.Join(h.home, "config"),
		"HELM_DATA_HOME="+filepath.Join(h.home, "data"),
	)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	return stdout.Bytes(), stderr.Bytes(), err
}

func (h helmTool) mustRun(t *testing.T, args ...string) []byte {
	t.Helper()
	out, errOut, err := h.run(args...)
	if err != nil {
		t.Fatalf("helm %s: %v\n%s%s", strings.Join(args, " "), err, out, errOut)
	}
	return out
}

func (h helmTool) template(t *testing.T, extra ...string) []byte {
	t.Helper()
	return h.mustRun(t, append([]string{"template", release, chartDir, "--namespace", namespace}, extra...)...)
}

func TestChart(t *testing.T) {
	h := buildHelm(t)
	outDir := t.TempDir()

	for _, r := range renders {
		t.Run(r.name, func(t *testing.T) {
			lint := h.mustRun(t, append([]string{"lint", "--strict", chartDir, "--namespace", namespace}, r.args()...)...)
			t.Logf("helm lint: %s", strings.TrimSpace(string(lint)))
			stream := h.template(t, r.args()...)
			file := filepath.Join(outDir, r.name+".yaml")
			if err := os.WriteFile(file, stream, 0o644); err != nil {
				t.Fatal(err)
			}
			objs := decodeAll(t, stream)
			if t.Failed() {
				t.FailNow()
			}
			t.Logf("decoded %d objects strictly: %s", len(objs), kindCounts(objs))
			checkRender(t, r, objs)
		})
	}

	t.Run("committed manifests", func(t *testing.T) {
		want := append([]byte(manifestHeader), h.template(t)...)
		if os.Getenv(updateEnv) != "" {
			if err := os.WriteFile(manifestPath, want, 0o644); err != nil {
				t.Fatal(err)
			}
			t.Logf("wrote %s", manifestPath)
			return
		}
		have, err := os.ReadFile(manifestPath)
		if err != nil {
			t.Fatalf("%v\nregenerate it: cd deploy/helm/test && %s=1 go test -count=1 -run 'TestChart/committed' ./...", err, updateEnv)
		}
		if !bytes.Equal(have, want) {
			t.Fatalf("deploy/k8s/opendsec.yaml differs from the chart's default render (first difference at line %d)\n"+
				"regenerate it: cd deploy/helm/test && %s=1 go test -count=1 -run 'TestChart/committed' ./...",
				firstDifferentLine(have, want), updateEnv)
		}
	})

	t.Run("no object per sandbox", func(t *testing.T) {
		// The edges make sandboxes outside Kubernetes: what the chart renders does not
		// depend on how many sandboxes a node may run.
		few := decodeAll(t, h.template(t, "--set", "edge.maxSandboxes=1"))
		many := decodeAll(t, h.template(t, "--set", "edge.maxSandboxes=100000"))
		if a, b := kindCounts(few), kindCounts(many); a != b {
			t.Errorf("the objects depend on edge.maxSandboxes: %s vs %s", a, b)
		}
		for _, o := range many {
			if o.Kind == "Pod" || strings.Contains(strings.ToLower(o.Kind+o.Name), "sandbox") {
				t.Errorf("%s looks like an object per sandbox", o)
			}
		}
	})

	t.Run("values dsec would refuse are refused", func(t *testing.T) {
		for _, bad := range [][]string{
			{"--set", "iam.replicas=4"},
			{"--set", "edge.nodes[0].name=edge-1"},
			{"--set", "edge.imageStore.type=pvc"},
			{"--set", "certificates.mode=manual"},
			{"--set", "edge.nodes=null"},
			{"--set", "iam.replica=5"},
		} {
			if out, _, err := h.run(append([]string{"template", release, chartDir, "--namespace", namespace}, bad...)...); err == nil {
				t.Errorf("%s was rendered:\n%.300s", strings.Join(bad, " "), out)
			}
		}
	})
}

func kindCounts(objs []object) string {
	n := map[string]int{}
	for _, o := range objs {
		n[o.Kind]++
	}
	var ks []string
	for k := range n {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	var parts []string
	for _, k := range ks {
		parts = append(parts, fmt.Sprintf("%d %s", n[k], k))
	}
	return strings.Join(parts, ", ")
}

func firstDifferentLine(a, b []byte) int {
	al, bl := strings.Split(string(a), "\n"), strings.Split(string(b), "\n")
	for i := 0; i < len(al) && i < len(bl); i++ {
		if al[i] != bl[i] {
			return i + 1
		}
	}
	return min(len(al), len(bl)) + 1
}

// find returns the one object of a kind and name.
func find[T any](t *testing.T, objs []object, kind, name string) T {
	t.Helper()
	var zero T
	for _, o := range objs {
		if o.Kind == kind && o.Name == name {
			v, ok := o.Obj.(T)
			if !ok {
				t.Fatalf("%s is a %T", o, o.Obj)
			}
			return v
		}
	}
	t.Fatalf("no %s %s rendered", kind, name)
	return zero
}

// component is one certificate identity the render needs.
type component struct{ role, name string }

func (c component) secret() string { return fmt.Sprintf("%s-tls-%s-%s", prefix, c.role, c.name) }
func (c component) spiffe() string { return fmt.Sprintf("spiffe://opendsec/%s/%s", c.role, c.name) }
func (c component) String() string { return c.role + "/" + c.name }

func (r render) components() []component {
	var cs []component
	for i := 1; i <= r.iam; i++ {
		cs = append(cs, component{"iam", fmt.Sprintf("iam%d", i)})
	}
	cs = append(cs, component{"apiserver", "api"}, component{"watcher", "watcher"})
	for _, e := range r.edges {
		cs = append(cs, component{"edge", e.name})
	}
	return cs
}

func checkRender(t *testing.T, r render, objs []object) {
	for _, o := range objs {
		if o.Namespace != namespace {
			t.Errorf("%s is in namespace %q, not %q", o, o.Namespace, namespace)
		}
	}
	checkNoMountInsideGeneratedVolume(t, objs)
	hostsOf := checkCertificates(t, r, objs)
	checkIAM(t, r, objs, hostsOf)
	checkAPIServer(t, r, objs, hostsOf)
	checkWatcher(t, objs)
	checkEdges(t, r, objs, hostsOf)
}

// checkNoMountInsideGeneratedVolume: no volume is mounted inside a ConfigMap, Secret or
// projected volume's mount (the kubelet rewrites those directories; a mount point the
// runtime makes in one is not stable).
func checkNoMountInsideGeneratedVolume(t *testing.T, objs []object) {
	t.Helper()
	for _, o := range objs {
		var pod corev1.PodSpec
		claims := map[string]bool{}
		switch v := o.Obj.(type) {
		case *appsv1.StatefulSet:
			pod = v.Spec.Template.Spec
			for _, c := range v.Spec.VolumeClaimTemplates {
				claims[c.Name] = true
			}
		case *appsv1.Deployment:
			pod = v.Spec.Template.Spec
		case *appsv1.DaemonSet:
			pod = v.Spec.Template.Spec
		case *batchv1.Job:
			pod = v.Spec.Template.Spec
		default:
			continue
		}
		for _, c := range append(append([]corev1.Container{}, pod.InitContainers...), pod.Containers...) {
			for _, outer := range c.VolumeMounts {
				v := volume(pod, outer.Name)
				if v == nil && claims[outer.Name] {
					continue
				}
				if v == nil {
					t.Errorf("%s: container %s mounts %s, which is not a volume", o, c.Name, outer.Name)
					continue
				}
				if v.ConfigMap == nil && v.Secret == nil && v.Projected == nil {
					continue
				}
				for _, inner := range c.VolumeMounts {
					if strings.HasPrefix(inner.MountPath, strings.TrimSuffix(outer.MountPath, "/")+"/") {
						t.Errorf("%s: container %s mounts %s inside %s (%s)", o, c.Name, inner.MountPath, outer.MountPath, outer.Name)
					}
				}
			}
		}
	}
}

// --- IAM --------------------------------------------------------------------------------

func checkIAM(t *testing.T, r render, objs []object, hostsOf map[string][]string) {
	name := prefix + "-iam"
	sts := find[*appsv1.StatefulSet](t, objs, "StatefulSet", name)
	if sts.Spec.Replicas == nil || int(*sts.Spec.Replicas) != r.iam {
		t.Errorf("IAM StatefulSet replicas = %v, want %d", sts.Spec.Replicas, r.iam)
	}
	if sts.Spec.PodManagementPolicy != appsv1.ParallelPodManagement {
		t.Errorf("IAM replicas must start together (Parallel), not %q", sts.Spec.PodManagementPolicy)
	}
	svc := find[*corev1.Service](t, objs, "Service", sts.Spec.ServiceName)
	if svc.Spec.ClusterIP != corev1.ClusterIPNone || !svc.Spec.PublishNotReadyAddresses {
		t.Errorf("the IAM Service %s must be headless and publish not-ready replicas", svc.Name)
	}
	if len(sts.Spec.VolumeClaimTemplates) != 1 || sts.Spec.VolumeClaimTemplates[0].Name != "data" {
		t.Fatalf("IAM needs one volumeClaimTemplate (its Raft log): %+v", sts.Spec.VolumeClaimTemplates)
	}
	pod := sts.Spec.Template.Spec
	c := container(t, pod, "iam")
	if m := mountAt(c, "/var/lib/dsec"); m == nil || m.Name != "data" {
		t.Errorf("the IAM data_dir is not on its claim")
	}
	if !strings.Contains(strings.Join(c.Command, " "), `/etc/dsec/config/iam$(( ${HOSTNAME##*-} + 1 )).toml`) {
		t.Errorf("the IAM pod does not pick its config by its ordinal: %q", c.Command)
	}
	cm := find[*corev1.ConfigMap](t, objs, "ConfigMap", name)
	if len(cm.Data) != r.iam {
		t.Errorf("the IAM ConfigMap has %d files, want %d", len(cm.Data), r.iam)
	}
	for id := 1; id <= r.iam; id++ {
		file := fmt.Sprintf("iam%d.toml", id)
		cfg := parseRoleConfig(t, cm.Data[file], file)
		if cfg.Role != "iam" || cfg.Name != fmt.Sprintf("iam%d", id) || cfg.IAM == nil || cfg.IAM.ID != id {
			t.Errorf("%s: role %q name %q iam %+v", file, cfg.Role, cfg.Name, cfg.IAM)
			continue
		}
		if len(cfg.IAM.Members) != r.iam {
			t.Errorf("%s: %d members, want %d", file, len(cfg.IAM.Members), r.iam)
		}
		for mid, addr := range cfg.IAM.Members {
			want := fmt.Sprintf("%s-%s.%s.%s.svc.cluster.local:7700", name, decr(mid), name, namespace)
			if addr != want {
				t.Errorf("%s: member %s is %q, want %q (the headless name of ordinal %s)", file, mid, addr, want, decr(mid))
			}
			host, _, _ := net.SplitHostPort(addr)
			if !slices.Contains(hostsOf["iam/iam"+mid], host) {
				t.Errorf("%s: member %s is dialled at %s, which its certificate does not name (%v)", file, mid, host, hostsOf["iam/iam"+mid])
			}
		}
		if (cfg.IAM.BootstrapKeyFile != "") != (id == 1) {
			t.Errorf("%s: bootstrap_key_file %q (only replica 1 writes the first admin key)", file, cfg.IAM.BootstrapKeyFile)
		}
		if id == 1 && !strings.HasPrefix(cfg.IAM.BootstrapKeyFile, "/var/lib/dsec/") {
			t.Errorf("the admin key %s is not on replica 1's volume", cfg.IAM.BootstrapKeyFile)
		}
		checkTLSFiles(t, pod, c, cfg, component{"iam", cfg.Name})
	}
}

func decr(id string) string {
	var n int
	fmt.Sscan(id, &n)
	return fmt.Sprint(n - 1)
}

// --- apiserver, watcher -------------------------------------------------------------------

func checkAPIServer(t *testing.T, r render, objs []object, hostsOf map[string][]string) {
	name := prefix + "-apiserver"
	d := find[*appsv1.Deployment](t, objs, "Deployment", name)
	if d.Spec.Replicas == nil || int(*d.Spec.Replicas) != r.apiservers {
		t.Errorf("apiserver replicas = %v, want %d", d.Spec.Replicas, r.apiservers)
	}
	svc := find[*corev1.Service](t, objs, "Service", name)
	if len(svc.Spec.Ports) != 1 || svc.Spec.Ports[0].Port != 7600 || svc.Spec.Ports[0].TargetPort.String() != "api" {
		t.Errorf("the apiserver Service must serve the API on 7600: %+v", svc.Spec.Ports)
	}
	pod := d.Spec.Template.Spec
	c := container(t, pod, "apiserver")
	cm := find[*corev1.ConfigMap](t, objs, "ConfigMap", name)
	cfg := parseRoleConfig(t, cm.Data["apiserver.toml"], "apiserver.toml")
	if cfg.Role != "apiserver" || cfg.PublicListen == "" {
		t.Errorf("apiserver.toml: role %q public_listen %q", cfg.Role, cfg.PublicListen)
	}
	if len(cfg.Cluster.IAM) != r.iam || len(cfg.Cluster.Edges) != len(r.edges) {
		t.Errorf("apiserver.toml: %d IAM replicas and %d edges, want %d and %d", len(cfg.Cluster.IAM), len(cfg.Cluster.Edges), r.iam, len(r.edges))
	}
	host, _, _ := net.SplitHostPort(cfg.Cluster.Watcher)
	if !slices.Contains(hostsOf["watcher/watcher"], host) {
		t.Errorf("the apiservers dial the watcher at %s, which its certificate does not name", host)
	}
	checkMountedConfig(t, pod, c, cm.Name, "/etc/dsec/config/apiserver.toml")
	checkTLSFiles(t, pod, c, cfg, component{"apiserver", cfg.Name})
	checkEdgeList(t, r, cfg, "apiserver.toml", hostsOf)
}

func checkWatcher(t *testing.T, objs []object) {
	name := prefix + "-watcher"
	d := find[*appsv1.Deployment](t, objs, "Deployment", name)
	if d.Spec.Replicas == nil || *d.Spec.Replicas != 1 {
		t.Errorf("the watcher must be one, not %v", d.Spec.Replicas)
	}
	find[*corev1.Service](t, objs, "Service", name)
	pod := d.Spec.Template.Spec
	c := container(t, pod, "watcher")
	cm := find[*corev1.ConfigMap](t, objs, "ConfigMap", name)
	cfg := parseRoleConfig(t, cm.Data["watcher.toml"], "watcher.toml")
	if cfg.Role != "watcher" || cfg.Watcher == nil || len(cfg.Cluster.Edges) == 0 {
		t.Errorf("watcher.toml: %+v", cfg)
	}
	checkMountedConfig(t, pod, c, cm.Name, "/etc/dsec/config/watcher.toml")
	checkTLSFiles(t, pod, c, cfg, component{"watcher", cfg.Name})
}

// --- edges --------------------------------------------------------------------------------

func checkEdges(t *testing.T, r render, objs []object, hostsOf map[string][]string) {
	name := prefix + "-edge"
	ds := find[*appsv1.DaemonSet](t, objs, "DaemonSet", name)
	pod := ds.Spec.Template.Spec
	if !pod.HostNetwork || !pod.HostPID || pod.DNSPolicy != corev1.DNSClusterFirstWithHostNet {
		t.Errorf("the edge needs hostNetwork, hostPID and ClusterFirstWithHostNet DNS: %v %v %q", pod.HostNetwork, pod.HostPID, pod.DNSPolicy)
	}
	c := container(t, pod, "edge")
	if c.SecurityContext == nil || c.SecurityContext.Privileged == nil || !*c.SecurityContext.Privileged {
		t.Errorf("the edge container is not privileged")
	}
	// The host paths it needs, each mounted where dsec looks.
	want := map[string]struct {
		hostPath string
		readOnly bool
	}{
		"/var/lib/dsec":  {"/var/lib/dsec", false},
		"/sys/fs/cgroup": {"/sys/fs/cgroup", false},
		"/lib/modules":   {"/lib/modules", true},
		"/dev/shm":       {"/dev/shm", false},
	}
	if r.kvm {
		want["/dev/kvm"] = struct {
			hostPath string
			readOnly bool
		}{"/dev/kvm", false}
	} else if mountAt(c, "/dev/kvm") != nil {
		t.Errorf("/dev/kvm is mounted though edge.kvm is false")
	}
	if r.imageClaim == "" {
		want["/srv/dsec-images"] = struct {
			hostPath string
			readOnly bool
		}{"/srv/dsec-images", false}
	}
	for mountPath, w := range want {
		m := mountAt(c, mountPath)
		if m == nil {
			t.Errorf("the edge does not mount %s", mountPath)
			continue
		}
		v := volume(pod, m.Name)
		if v == nil || v.HostPath == nil || v.HostPath.Path != w.hostPath {
			t.Errorf("the edge's %s is not the node's %s: %+v", mountPath, w.hostPath, v)
		}
		if m.ReadOnly != w.readOnly {
			t.Errorf("the edge's %s: readOnly %v, want %v", mountPath, m.ReadOnly, w.readOnly)
		}
	}
	if r.imageClaim != "" {
		m := mountAt(c, "/srv/dsec-images")
		if m == nil {
			t.Fatalf("the edge does not mount the image store")
		}
		v := volume(pod, m.Name)
		if v == nil || v.PersistentVolumeClaim == nil || v.PersistentVolumeClaim.ClaimName != r.imageClaim {
			t.Errorf("the image store is not the claim %s: %+v", r.imageClaim, v)
		}
	}
	for _, p := range []string{"/var/lib/dsec", "/srv/dsec-images"} {
		if m := mountAt(c, p); m != nil && (m.MountPropagation == nil || *m.MountPropagation != corev1.MountPropagationBidirectional) {
			t.Errorf("the edge's %s must propagate mounts both ways", p)
		}
	}
	// Only on the listed nodes.
	var nodes []string
	if a := pod.Affinity; a != nil && a.NodeAffinity != nil && a.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution != nil {
		for _, term := range a.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution.NodeSelectorTerms {
			for _, f := range term.MatchFields {
				if f.Key == "metadata.name" && f.Operator == corev1.NodeSelectorOpIn {
					nodes = append(nodes, f.Values...)
				}
			}
		}
	}
	var wantNodes []string
	for _, e := range r.edges {
		wantNodes = append(wantNodes, e.node)
	}
	if !slices.Equal(nodes, wantNodes) {
		t.Errorf("the edge DaemonSet runs on %v, want the nodes of edge.nodes %v", nodes, wantNodes)
	}
	if !strings.Contains(strings.Join(c.Command, " "), `/etc/dsec/config/${NODE_NAME}.toml`) || !hasFieldEnv(c, "NODE_NAME", "spec.nodeName") {
		t.Errorf("the edge does not pick its node's config: %q", c.Command)
	}

	fields := edgeConfigFields(t)
	cm := find[*corev1.ConfigMap](t, objs, "ConfigMap", name)
	if len(cm.Data) != len(r.edges) {
		t.Errorf("the edge ConfigMap has %d files, want %d", len(cm.Data), len(r.edges))
	}
	for _, e := range r.edges {
		file := e.node + ".toml"
		checkMountedConfig(t, pod, c, cm.Name, "/etc/dsec/config/"+file)
		cfg := parseRoleConfig(t, cm.Data[file], file)
		if cfg.Role != "edge" || cfg.Name != e.name {
			t.Errorf("%s: role %q name %q, want edge %s", file, cfg.Role, cfg.Name, e.name)
		}
		if len(cfg.Cluster.IAM) != r.iam {
			t.Errorf("%s: %d IAM replicas, want %d", file, len(cfg.Cluster.IAM), r.iam)
		}
		if sd, _ := cfg.Edge["state_dir"].(string); !strings.HasPrefix(sd, "/var/lib/dsec/") {
			t.Errorf("%s: state_dir %q is not on the node's /var/lib/dsec", file, sd)
		}
		if is, _ := cfg.Edge["image_store"].(string); is != "/srv/dsec-images" {
			t.Errorf("%s: image_store %q is not where the store is mounted", file, is)
		}
		for k, v := range cfg.Edge {
			typ, ok := fields[k]
			if !ok {
				t.Errorf("%s: [edge] %s is not a field of EdgeConfig (crates/edge/src/config.rs)", file, k)
				continue
			}
			if regexp.MustCompile(`^(u8|u16|u32|u64|usize|i64)$`).MatchString(typ) {
				if _, isInt := v.(int64); !isInt {
					t.Errorf("%s: [edge] %s = %v (%T): EdgeConfig wants an integer (%s)", file, k, v, v, typ)
				}
			}
		}
		checkTLSFiles(t, pod, c, cfg, component{"edge", e.name})
		checkEdgeList(t, r, cfg, file, hostsOf)
	}
}

// checkEdgeList: a config lists every edge at its address, which its certificate names.
func checkEdgeList(t *testing.T, r render, cfg roleConfig, file string, hostsOf map[string][]string) {
	t.Helper()
	for _, e := range r.edges {
		addr := cfg.Cluster.Edges[e.name]
		if addr != e.address+":7700" {
			t.Errorf("%s: edge %s at %q, want %s:7700", file, e.name, addr, e.address)
		}
		if !slices.Contains(hostsOf["edge/"+e.name], e.address) {
			t.Errorf("edge %s is dialled at %s, which its certificate does not name (%v)", e.name, e.address, hostsOf["edge/"+e.name])
		}
	}
}

// edgeConfigFields reads the fields of EdgeConfig, with their Rust types, from the edge's
// source, so that a key the chart writes into [edge] is one dsec knows.
func edgeConfigFields(t *testing.T) map[string]string {
	t.Helper()
	src, err := os.ReadFile(edgeConfigRS)
	if err != nil {
		t.Fatalf("reading EdgeConfig's fields: %v", err)
	}
	s := string(src)
	i := strings.Index(s, "pub struct EdgeConfig {")
	if i < 0 {
		t.Fatalf("%s has no pub struct EdgeConfig", edgeConfigRS)
	}
	body := s[i:]
	body = body[:strings.Index(body, "\n}")]
	fields := map[string]string{}
	for _, m := range regexp.MustCompile(`(?m)^\s*pub (\w+): ([^,]+),`).FindAllStringSubmatch(body, -1) {
		fields[m[1]] = strings.TrimSpace(m[2])
	}
	if len(fields) < 10 {
		t.Fatalf("found only %d fields of EdgeConfig in %s", len(fields), edgeConfigRS)
	}
	return fields
}

// --- certificates ---------------------------------------------------------------------------

// dsec certs issue --host takes an IP address or a DNS name of these labels (pki.rs).
var dnsLabel = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9-]{0,62}$`)

func validHost(h string) bool {
	if net.ParseIP(h) != nil {
		return true
	}
	if len(h) > 253 {
		return false
	}
	for _, l := range strings.Split(h, ".") {
		if !dnsLabel.MatchString(l) {
			return false
		}
	}
	return true
}

// checkCertificates checks that every component's certificate is made, by the Job or by
// cert-manager, and returns the hosts each certificate names, by "role/name".
func checkCertificates(t *testing.T, r render, objs []object) map[string][]string {
	hostsOf := map[string][]string{}
	var jobs, certs, issuers int
	for _, o := range objs {
		switch o.Kind {
		case "Job":
			jobs++
		case "Certificate":
			certs++
		case "Issuer":
			issuers++
		}
	}
	comps := r.components()
	switch r.mode {
	case "job":
		if certs+issuers != 0 {
			t.Errorf("mode job rendered %d cert-manager objects", certs+issuers)
		}
		name := prefix + "-certs"
		job := find[*batchv1.Job](t, objs, "Job", name)
		for _, o := range []object{findObject(t, objs, "ServiceAccount", name), findObject(t, objs, "Role", name), findObject(t, objs, "RoleBinding", name), findObject(t, objs, "Job", name)} {
			meta := o.Obj.(interface{ GetAnnotations() map[string]string })
			if meta.GetAnnotations()["helm.sh/hook"] != "pre-install,pre-upgrade" {
				t.Errorf("%s is not a pre-install/pre-upgrade hook", o)
			}
		}
		role := find[*rbacv1.Role](t, objs, "Role", name)
		if len(role.Rules) != 1 || !slices.Equal(role.Rules[0].Resources, []string{"secrets"}) ||
			!slices.Equal(role.Rules[0].APIGroups, []string{""}) || !slices.Equal(role.Rules[0].Verbs, []string{"create", "get", "patch"}) {
			t.Errorf("the Job's Role must allow only create/get/patch of Secrets: %+v", role.Rules)
		}
		rb := find[*rbacv1.RoleBinding](t, objs, "RoleBinding", name)
		if rb.RoleRef.Name != name || len(rb.Subjects) != 1 || rb.Subjects[0].Name != name || job.Spec.Template.Spec.ServiceAccountName != name {
			t.Errorf("the Job does not run as the bound ServiceAccount")
		}
		pod := job.Spec.Template.Spec
		if len(pod.InitContainers) != 1 || !strings.HasPrefix(pod.InitContainers[0].Image, "ghcr.io/opendsec/dsec:") {
			t.Errorf("the Job's dsec must come from the main image in an initContainer: %+v", pod.InitContainers)
		}
		c := container(t, pod, "certs")
		if !strings.HasPrefix(c.Image, "docker.io/alpine/k8s:") {
			t.Errorf("the Job runs in %s, not certificates.kubectlImage", c.Image)
		}
		script := c.Command[len(c.Command)-1]
		if out, err := exec.Command("sh", "-n", "-c", script).CombinedOutput(); err != nil {
			t.Errorf("the Job's script is not valid sh: %v\n%s", err, out)
		}
		if !strings.Contains(script, "/tools/dsec certs init") {
			t.Errorf("the Job does not make the CA with dsec certs init")
		}
		for _, comp := range comps {
			re := regexp.MustCompile(`(?m)^issue ` + regexp.QuoteMeta(comp.secret()) + ` ` + comp.role + ` ` + comp.name + ` (.+)$`)
			m := re.FindStringSubmatch(script)
			if m == nil {
				t.Errorf("the Job does not issue %s into %s", comp, comp.secret())
				continue
			}
			hosts := strings.Fields(m[1])
			for _, h := range hosts {
				if !validHost(h) {
					t.Errorf("%s: dsec certs issue would refuse --host %q", comp, h)
				}
			}
			hostsOf[comp.String()] = hosts
		}
	case "certManager":
		if jobs != 0 {
			t.Errorf("mode certManager rendered a Job")
		}
		bySecret := map[string]*Certificate{}
		for _, o := range objs {
			switch v := o.Obj.(type) {
			case *Certificate:
				if err := v.validate(); err != nil {
					t.Errorf("%s: %v", o, err)
				}
				bySecret[v.Spec.SecretName] = v
			case *Issuer:
				if err := v.validate(); err != nil {
					t.Errorf("%s: %v", o, err)
				}
			}
		}
		ca, ok := bySecret[prefix+"-ca"]
		if !ok || !ca.Spec.IsCA {
			t.Errorf("no CA Certificate %s-ca", prefix)
		}
		for _, comp := range comps {
			c, ok := bySecret[comp.secret()]
			if !ok {
				t.Errorf("no Certificate for %s (Secret %s)", comp, comp.secret())
				continue
			}
			if !slices.Equal(c.Spec.URIs, []string{comp.spiffe()}) {
				t.Errorf("%s: uris %v, want [%s]", comp, c.Spec.URIs, comp.spiffe())
			}
			for _, u := range []string{"server auth", "client auth"} {
				if !slices.Contains(c.Spec.Usages, u) {
					t.Errorf("%s: usages %v lack %q (each certificate is both server and client)", comp, c.Spec.Usages, u)
				}
			}
			if c.Spec.IsCA {
				t.Errorf("%s is a CA", comp)
			}
			if _, ok := findIssuer(objs, c.Spec.IssuerRef.Name); !ok {
				t.Errorf("%s: issuer %s is not rendered", comp, c.Spec.IssuerRef.Name)
			}
			hostsOf[comp.String()] = append(append([]string{}, c.Spec.DNSNames...), c.Spec.IPAddresses...)
		}
	default:
		t.Fatalf("unknown mode %q", r.mode)
	}
	return hostsOf
}

func findIssuer(objs []object, name string) (*Issuer, bool) {
	for _, o := range objs {
		if i, ok := o.Obj.(*Issuer); ok && o.Name == name {
			return i, true
		}
	}
	return nil, false
}

func findObject(t *testing.T, objs []object, kind, name string) object {
	t.Helper()
	for _, o := range objs {
		if o.Kind == kind && o.Name == name {
			return o
		}
	}
	t.Fatalf("no %s %s rendered", kind, name)
	return object{}
}

// --- pods -----------------------------------------------------------------------------------

func container(t *testing.T, pod corev1.PodSpec, name string) *corev1.Container {
	t.Helper()
	for i := range pod.Containers {
		if pod.Containers[i].Name == name {
			return &pod.Containers[i]
		}
	}
	t.Fatalf("no container %s", name)
	return nil
}

func volume(pod corev1.PodSpec, name string) *corev1.Volume {
	for i := range pod.Volumes {
		if pod.Volumes[i].Name == name {
			return &pod.Volumes[i]
		}
	}
	return nil
}

func mountAt(c *corev1.Container, p string) *corev1.VolumeMount {
	for i := range c.VolumeMounts {
		if c.VolumeMounts[i].MountPath == p {
			return &c.VolumeMounts[i]
		}
	}
	return nil
}

func hasFieldEnv(c *corev1.Container, name, field string) bool {
	for _, e := range c.Env {
		if e.Name == name && e.ValueFrom != nil && e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == field {
			return true
		}
	}
	return false
}

// fileSource is where a file a container reads comes from.
type fileSource struct{ configMap, secret, key string }

// resolve finds the ConfigMap or Secret key behind a path in a container: the deepest
// mount above it, then the volume's items (or the key named by the rest of the path).
func resolve(pod corev1.PodSpec, c *corev1.Container, file string) (fileSource, bool) {
	var best *corev1.VolumeMount
	for i := range c.VolumeMounts {
		m := &c.VolumeMounts[i]
		if strings.HasPrefix(file, strings.TrimSuffix(m.MountPath, "/")+"/") && (best == nil || len(m.MountPath) > len(best.MountPath)) {
			best = m
		}
	}
	if best == nil {
		return fileSource{}, false
	}
	rel := strings.TrimPrefix(file, strings.TrimSuffix(best.MountPath, "/")+"/")
	v := volume(pod, best.Name)
	if v == nil {
		return fileSource{}, false
	}
	fromItems := func(items []corev1.KeyToPath, whole bool) (string, bool) {
		if len(items) == 0 {
			return rel, whole && !strings.Contains(rel, "/")
		}
		for _, it := range items {
			if path.Clean(it.Path) == rel {
				return it.Key, true
			}
		}
		return "", false
	}
	switch {
	case v.Secret != nil:
		if k, ok := fromItems(v.Secret.Items, true); ok {
			return fileSource{secret: v.Secret.SecretName, key: k}, true
		}
	case v.ConfigMap != nil:
		if k, ok := fromItems(v.ConfigMap.Items, true); ok {
			return fileSource{configMap: v.ConfigMap.Name, key: k}, true
		}
	case v.Projected != nil:
		for _, src := range v.Projected.Sources {
			if src.Secret != nil {
				if k, ok := fromItems(src.Secret.Items, false); ok {
					return fileSource{secret: src.Secret.Name, key: k}, true
				}
			}
		}
	}
	return fileSource{}, false
}

// checkTLSFiles: the [tls] files of a config are the keys of the component's Secret.
func checkTLSFiles(t *testing.T, pod corev1.PodSpec, c *corev1.Container, cfg roleConfig, comp component) {
	t.Helper()
	for file, key := range map[string]string{cfg.TLS.CA: "ca.crt", cfg.TLS.Cert: "tls.crt", cfg.TLS.Key: "tls.key"} {
		src, ok := resolve(pod, c, file)
		if !ok {
			t.Errorf("%s: %s is not mounted in container %s", comp, file, c.Name)
			continue
		}
		if src.secret != comp.secret() || src.key != key {
			t.Errorf("%s: %s comes from %+v, want Secret %s key %s", comp, file, src, comp.secret(), key)
		}
	}
}

// checkMountedConfig: the config file a container is started with is the ConfigMap's.
func checkMountedConfig(t *testing.T, pod corev1.PodSpec, c *corev1.Container, configMap, file string) {
	t.Helper()
	src, ok := resolve(pod, c, file)
	if !ok || src.configMap != configMap || src.key != path.Base(file) {
		t.Errorf("%s: %s is not key %s of ConfigMap %s (%+v)", c.Name, file, path.Base(file), configMap, src)
	}
	if !strings.Contains(strings.Join(c.Command, " "), path.Dir(file)) {
		t.Errorf("%s: its command does not name %s: %q", c.Name, file, c.Command)
	}
}

// --- role configs -----------------------------------------------------------------------------

// roleConfig mirrors RoleConfig of crates/cli/src/cmd/role.rs (serde deny_unknown_fields):
// a key it does not have fails the decoding.
type roleConfig struct {
	Role         string `toml:"role"`
	Name         string `toml:"name"`
	DataDir      string `toml:"data_dir"`
	Listen       string `toml:"listen"`
	PublicListen string `toml:"public_listen"`
	TLS          struct {
		CA   string `toml:"ca"`
		Cert string `toml:"cert"`
		Key  string `toml:"key"`
	} `toml:"tls"`
	Cluster struct {
		IAM     []string          `toml:"iam"`
		Watcher string            `toml:"watcher"`
		Edges   map[string]string `toml:"edges"`
	} `toml:"cluster"`
	IAM *struct {
		ID                int               `toml:"id"`
		Members           map[string]string `toml:"members"`
		BootstrapKeyFile  string            `toml:"bootstrap_key_file"`
		HeartbeatMs       *int              `toml:"heartbeat_ms"`
		ElectionTimeoutMs []int             `toml:"election_timeout_ms"`
	} `toml:"iam"`
	// The [edge] table is checked key by key against EdgeConfig's fields.
	Edge    map[string]any `toml:"edge"`
	Watcher *struct {
		PollMs int `toml:"poll_ms"`
	} `toml:"watcher"`
}

var componentName = regexp.MustCompile(`^[a-z0-9-]{1,63}$`)

func parseRoleConfig(t *testing.T, text, file string) roleConfig {
	t.Helper()
	var cfg roleConfig
	md, err := toml.Decode(text, &cfg)
	if err != nil {
		t.Fatalf("%s is not valid TOML: %v\n%s", file, err, text)
	}
	// [edge] decodes into a map (its keys are checked against EdgeConfig's fields).
	for _, k := range md.Undecoded() {
		if len(k) == 0 || k[0] != "edge" {
			t.Errorf("%s: a key dsec does not know: %s", file, k)
		}
	}
	for _, k := range []string{"role", "name", "data_dir", "listen", "tls.ca", "tls.cert", "tls.key"} {
		if !md.IsDefined(strings.Split(k, ".")...) {
			t.Errorf("%s: %s is missing", file, k)
		}
	}
	if !componentName.MatchString(cfg.Name) {
		t.Errorf("%s: name %q is not a component name", file, cfg.Name)
	}
	// listen and public_listen are socket addresses (an IP, not a name).
	for _, a := range []string{cfg.Listen, cfg.PublicListen} {
		if a == "" {
			continue
		}
		host, _, err := net.SplitHostPort(a)
		if err != nil || net.ParseIP(host) == nil {
			t.Errorf("%s: %q is not an IP:port", file, a)
		}
	}
	return cfg
}
