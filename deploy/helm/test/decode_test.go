// SPDX-License-Identifier: AGPL-3.0-only

package test

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kjson "sigs.k8s.io/json"
	"sigs.k8s.io/yaml"
)

// The object kinds the chart may render, by apiVersion and kind, each with the Go type it
// is decoded into: k8s.io/api's for Kubernetes' own kinds, the local mirrors of
// certmanager_test.go for cert-manager's. Anything else fails the test.
var kinds = map[string]func() any{
	"v1/ConfigMap":                             func() any { return &corev1.ConfigMap{} },
	"v1/Service":                               func() any { return &corev1.Service{} },
	"v1/ServiceAccount":                        func() any { return &corev1.ServiceAccount{} },
	"apps/v1/StatefulSet":                      func() any { return &appsv1.StatefulSet{} },
	"apps/v1/Deployment":                       func() any { return &appsv1.Deployment{} },
	"apps/v1/DaemonSet":                        func() any { return &appsv1.DaemonSet{} },
	"batch/v1/Job":                             func() any { return &batchv1.Job{} },
	"policy/v1/PodDisruptionBudget":            func() any { return &policyv1.PodDisruptionBudget{} },
	"rbac.authorization.k8s.io/v1/Role":        func() any { return &rbacv1.Role{} },
	"rbac.authorization.k8s.io/v1/RoleBinding": func() any { return &rbacv1.RoleBinding{} },
	"cert-manager.io/v1/Certificate":           func() any { return &Certificate{} },
	"cert-manager.io/v1/Issuer":                func() any { return &Issuer{} },
}

// object is one decoded document of a render.
type object struct {
	APIVersion, Kind, Name, Namespace string
	// Source is helm's "# Source:" line, for messages.
	Source string
	// Obj is the typed object (*appsv1.StatefulSet, *Certificate, ...).
	Obj any
}

func (o object) String() string {
	return fmt.Sprintf("%s %s/%s (%s)", o.APIVersion, o.Kind, o.Name, o.Source)
}

// splitDocuments splits a multi-document YAML stream at its "---" lines, leaving out the
// documents that hold nothing but comments and blank lines.
func splitDocuments(stream []byte) [][]byte {
	var docs [][]byte
	var cur bytes.Buffer
	flush := func() {
		if hasContent(cur.Bytes()) {
			docs = append(docs, bytes.Clone(cur.Bytes()))
		}
		cur.Reset()
	}
	sc := bufio.NewScanner(bytes.NewReader(stream))
	sc.Buffer(make([]byte, 1<<20), 1<<24)
	for sc.Scan() {
		line := sc.Text()
		if strings.TrimRight(line, " \t") == "---" {
			flush()
			continue
		}
		cur.WriteString(line)
		cur.WriteByte('\n')
	}
	flush()
	return docs
}

func hasContent(doc []byte) bool {
	for _, l := range strings.Split(string(doc), "\n") {
		l = strings.TrimSpace(l)
		if l != "" && !strings.HasPrefix(l, "#") {
			return true
		}
	}
	return false
}

// decodeStrict decodes one YAML document into obj the way the API server's strict field
// validation does: YAML to JSON refusing duplicate keys, then JSON into the typed struct
// with sigs.k8s.io/json, which matches field names case-sensitively (encoding/json, under
// sigs.k8s.io/yaml's UnmarshalStrict, would take "Replicas" for "replicas") and refuses
// unknown and duplicate fields.
func decodeStrict(doc []byte, obj any) error {
	j, err := yaml.YAMLToJSONStrict(doc)
	if err != nil {
		return fmt.Errorf("YAML: %w", err)
	}
	strictErrs, err := kjson.UnmarshalStrict(j, obj)
	if err != nil {
		return err
	}
	return errors.Join(strictErrs...)
}

// decodeAll decodes every document of a render into its Go type, failing the test for a
// document of an unknown kind or one that does not decode strictly.
func decodeAll(t *testing.T, stream []byte) []object {
	t.Helper()
	var out []object
	for i, doc := range splitDocuments(stream) {
		source := ""
		for _, l := range strings.Split(string(doc), "\n") {
			if s, ok := strings.CutPrefix(l, "# Source: "); ok {
				source = s
				break
			}
		}
		var tm metav1.TypeMeta
		if err := yaml.Unmarshal(doc, &tm); err != nil {
			t.Errorf("document %d (%s): %v", i, source, err)
			continue
		}
		key := tm.APIVersion + "/" + tm.Kind
		mk, ok := kinds[key]
		if !ok {
			t.Errorf("document %d (%s): unknown kind %q: add it to kinds (with its Go type) if the chart should render it", i, source, key)
			continue
		}
		obj := mk()
		if err := decodeStrict(doc, obj); err != nil {
			t.Errorf("document %d (%s), %s: %v", i, source, key, err)
			continue
		}
		m, ok := obj.(metav1.Object)
		if !ok {
			t.Fatalf("%T has no ObjectMeta", obj)
		}
		out = append(out, object{APIVersion: tm.APIVersion, Kind: tm.Kind, Name: m.GetName(), Namespace: m.GetNamespace(), Source: source, Obj: obj})
	}
	return out
}

// The strict decoder must refuse what the API server's strict validation refuses: a
// decoder that accepted anything would make every other check of the chart vacuous.
func TestStrictDecoderRefusesWhatIsNotInTheSchema(t *testing.T) {
	const good = `apiVersion: apps/v1
kind: StatefulSet
metadata:
  name: s
spec:
  serviceName: s
  replicas: 3
  selector:
    matchLabels: {app: s}
  template:
    metadata:
      labels: {app: s}
    spec:
      containers:
        - name: c
          image: i
`
	var ok appsv1.StatefulSet
	if err := decodeStrict([]byte(good), &ok); err != nil {
		t.Fatalf("a valid StatefulSet was refused: %v", err)
	}
	if ok.Spec.Replicas == nil || *ok.Spec.Replicas != 3 || ok.Spec.Template.Spec.Containers[0].Image != "i" {
		t.Fatalf("decoded wrongly: %+v", ok.Spec)
	}
	bad := map[string]string{
		"an unknown field":            strings.Replace(good, "  replicas: 3\n", "  replicas: 3\n  replicaz: 3\n", 1),
		"an unknown nested field":     strings.Replace(good, "          image: i\n", "          image: i\n          privileged: true\n", 1),
		"a field in the wrong case":   strings.Replace(good, "  replicas: 3\n", "  Replicas: 3\n", 1),
		"a duplicate key":             strings.Replace(good, "  replicas: 3\n", "  replicas: 3\n  replicas: 4\n", 1),
		"a string for an int32 field": strings.Replace(good, "  replicas: 3\n", "  replicas: three\n", 1),
	}
	for what, doc := range bad {
		var s appsv1.StatefulSet
		if err := decodeStrict([]byte(doc), &s); err == nil {
			t.Errorf("%s was accepted", what)
		} else {
			t.Logf("%s refused: %v", what, err)
		}
	}
	// The same for the local cert-manager mirror.
	cert := `apiVersion: cert-manager.io/v1
kind: Certificate
metadata: {name: c}
spec:
  secretName: c
  uris: ["spiffe://opendsec/edge/e1"]
  issuerRef: {name: ca}
  keystores: {}
`
	var c Certificate
	if err := decodeStrict([]byte(cert), &c); err == nil {
		t.Errorf("a Certificate with a field the mirror lacks was accepted")
	}
}

func TestDocumentsAreSplitAtSeparatorLines(t *testing.T) {
	docs := splitDocuments([]byte("---\n# Source: a\n# only a comment\n---\na: 1\n---  \nb: |\n  x---\n  ---y\n"))
	if len(docs) != 2 || string(docs[0]) != "a: 1\n" || !strings.Contains(string(docs[1]), "x---") {
		t.Fatalf("got %q", docs)
	}
}
