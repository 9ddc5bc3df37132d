// SPDX-License-Identifier: AGPL-3.0-only

package test

import (
	"fmt"
	"net"
	"net/url"
	"slices"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// cert-manager's Certificate and Issuer are CRDs, not in k8s.io/api. Rather than import
// cert-manager (and its dependency tree) for two types, these mirror the fields of its v1
// API (github.com/cert-manager/cert-manager/pkg/apis/certmanager/v1, types_certificate.go
// and types_issuer.go) that the chart uses, with the same JSON names, and nothing more:
// decoded with unknown fields disallowed, a misspelt field, or one the chart starts using
// without it being added here (checked against cert-manager's API), fails the test.

// Certificate mirrors cert-manager.io/v1 Certificate.
type Certificate struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`
	Spec              CertificateSpec `json:"spec"`
}

// CertificateSpec mirrors the fields of cert-manager's CertificateSpec the chart sets.
type CertificateSpec struct {
	CommonName  string                 `json:"commonName,omitempty"`
	Duration    string                 `json:"duration,omitempty"`
	RenewBefore string                 `json:"renewBefore,omitempty"`
	DNSNames    []string               `json:"dnsNames,omitempty"`
	IPAddresses []string               `json:"ipAddresses,omitempty"`
	URIs        []string               `json:"uris,omitempty"`
	SecretName  string                 `json:"secretName"`
	IssuerRef   IssuerReference        `json:"issuerRef"`
	IsCA        bool                   `json:"isCA,omitempty"`
	Usages      []string               `json:"usages,omitempty"`
	PrivateKey  *CertificatePrivateKey `json:"privateKey,omitempty"`
}

// IssuerReference mirrors cert-manager's ObjectReference (cmmeta.IssuerReference).
type IssuerReference struct {
	Name  string `json:"name"`
	Kind  string `json:"kind,omitempty"`
	Group string `json:"group,omitempty"`
}

// CertificatePrivateKey mirrors cert-manager's CertificatePrivateKey.
type CertificatePrivateKey struct {
	RotationPolicy string `json:"rotationPolicy,omitempty"`
	Encoding       string `json:"encoding,omitempty"`
	Algorithm      string `json:"algorithm,omitempty"`
	Size           int    `json:"size,omitempty"`
}

// Issuer mirrors cert-manager.io/v1 Issuer.
type Issuer struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`
	Spec              IssuerSpec `json:"spec"`
}

// IssuerSpec mirrors the issuer types of cert-manager's IssuerConfig the chart uses.
type IssuerSpec struct {
	SelfSigned *SelfSignedIssuer `json:"selfSigned,omitempty"`
	CA         *CAIssuer         `json:"ca,omitempty"`
}

// SelfSignedIssuer mirrors cert-manager's SelfSignedIssuer.
type SelfSignedIssuer struct {
	CRLDistributionPoints []string `json:"crlDistributionPoints,omitempty"`
}

// CAIssuer mirrors cert-manager's CAIssuer.
type CAIssuer struct {
	SecretName string `json:"secretName"`
}

// cert-manager's KeyUsage values (types.go), as its API accepts them.
var certManagerUsages = []string{
	"signing", "digital signature", "content commitment", "key encipherment",
	"key agreement", "data encipherment", "cert sign", "crl sign", "encipher only",
	"decipher only", "any", "server auth", "client auth", "code signing", "email protection",
	"s/mime", "ipsec end system", "ipsec tunnel", "ipsec user", "timestamping",
	"ocsp signing", "microsoft sgc", "netscape sgc",
}

// validate checks what the CRD's OpenAPI schema and cert-manager's webhook would: enums,
// durations, addresses.
func (c *Certificate) validate() error {
	s := c.Spec
	if s.SecretName == "" || s.IssuerRef.Name == "" {
		return fmt.Errorf("secretName and issuerRef.name are required")
	}
	if s.IssuerRef.Kind != "" && s.IssuerRef.Kind != "Issuer" && s.IssuerRef.Kind != "ClusterIssuer" && s.IssuerRef.Group == "cert-manager.io" {
		return fmt.Errorf("issuerRef.kind %q", s.IssuerRef.Kind)
	}
	for _, d := range []string{s.Duration, s.RenewBefore} {
		if d == "" {
			continue
		}
		if _, err := time.ParseDuration(d); err != nil {
			return fmt.Errorf("duration %q: %v", d, err)
		}
	}
	for _, u := range s.Usages {
		if !slices.Contains(certManagerUsages, u) {
			return fmt.Errorf("usage %q is not one of cert-manager's", u)
		}
	}
	for _, ip := range s.IPAddresses {
		if net.ParseIP(ip) == nil {
			return fmt.Errorf("ipAddresses: %q is not an IP address", ip)
		}
	}
	for _, u := range s.URIs {
		if p, err := url.Parse(u); err != nil || p.Scheme == "" {
			return fmt.Errorf("uris: %q is not a URI", u)
		}
	}
	if k := s.PrivateKey; k != nil {
		if k.Algorithm != "" && !slices.Contains([]string{"RSA", "ECDSA", "Ed25519"}, k.Algorithm) {
			return fmt.Errorf("privateKey.algorithm %q", k.Algorithm)
		}
		if k.Encoding != "" && !slices.Contains([]string{"PKCS1", "PKCS8"}, k.Encoding) {
			return fmt.Errorf("privateKey.encoding %q", k.Encoding)
		}
		if k.RotationPolicy != "" && !slices.Contains([]string{"Never", "Always"}, k.RotationPolicy) {
			return fmt.Errorf("privateKey.rotationPolicy %q", k.RotationPolicy)
		}
		if k.Algorithm == "ECDSA" && !slices.Contains([]int{0, 256, 384, 521}, k.Size) {
			return fmt.Errorf("privateKey.size %d for ECDSA", k.Size)
		}
	}
	return nil
}

func (i *Issuer) validate() error {
	n := 0
	if i.Spec.SelfSigned != nil {
		n++
	}
	if i.Spec.CA != nil {
		n++
		if i.Spec.CA.SecretName == "" {
			return fmt.Errorf("ca.secretName is required")
		}
	}
	if n != 1 {
		return fmt.Errorf("an Issuer needs exactly one issuer type, has %d", n)
	}
	return nil
}
