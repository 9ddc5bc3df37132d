// SPDX-License-Identifier: AGPL-3.0-only

//go:build tools

// Package test pins the helm CLI the chart test builds (go build helm.sh/helm/v4/cmd/helm),
// so that its version and every dependency's are those in go.mod/go.sum.
package test

import (
	_ "helm.sh/helm/v4/cmd/helm"
)
